"""Tests of `cache_windows`: decoding in phases over caches that grow.

Shape legend: `B` batch, `L` total length, `G` key/value heads, `K` head
size, `S` source length.

The generation tests shrink the first window to 8 positions (windows of 8,
12, 16, 24, ...), so that a tiny model's run of a few tokens spans several
phases, and compare it, token for
token, with the same model decoding in one phase (and with recomputing every
step). Every backend runs the phases there, torch included, whose loop
otherwise keeps one phase (`Preferences.cache_windows`).
"""

import dataclasses

import keras
import numpy as np
import pytest

import harness
from keras_attention import backend
from keras_attention import kv_cache
from keras_attention.models import GPT
from keras_attention.models import Seq2SeqTransformer
from keras_attention.models import cache_windows

BACKEND = keras.backend.backend()
V, MAX_LENGTH = 29, 24


@pytest.fixture
def phases_seen(monkeypatch):
    """The phase lengths of every loop traced (or run eagerly) while a test
    runs, windowed on every backend, from a first window of 8."""
    monkeypatch.setattr(cache_windows, "FIRST_WINDOW", 8)
    preferences = backend.preferences()
    monkeypatch.setattr(
        backend, "preferences", lambda: dataclasses.replace(preferences, cache_windows=True)
    )
    seen = []
    plan = cache_windows.Phases.plan.__func__

    def recording_plan(cls, *args, **kwargs):
        caches, phases = plan(cls, *args, **kwargs)
        seen.append(phases.lengths)
        return caches, phases

    monkeypatch.setattr(cache_windows.Phases, "plan", classmethod(recording_plan))
    return seen


def _one_phase(monkeypatch):
    """Every later loop in one phase (a first window past any length)."""
    monkeypatch.setattr(cache_windows, "FIRST_WINDOW", 1 << 20)


def _randomized(model, seed):
    """`model` with random weights whose greedy continuations vary (no
    collapse onto one token): norms near 1, small offsets, unit embeddings,
    kernels of three times the unit-variance scale."""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        shape, name = tuple(variable.shape), variable.path.split("/")[-1]
        if "float" not in keras.backend.standardize_dtype(variable.dtype):
            continue
        if name == "gamma":
            value = 1 + 0.2 * rng.normal(size=shape)
        elif name in ("beta", "bias"):
            value = 0.1 * rng.normal(size=shape)
        elif name == "embeddings":
            value = rng.normal(size=shape)
        else:  # (D, H, K) projections read D; output ones (H, K, D) read H K
            fan_in = np.prod(shape[:-1]) if "output" in variable.path else shape[0]
            value = 3 * rng.normal(size=shape) / np.sqrt(fan_in)
        variable.assign(value.astype("float32"))
    return model


def _gpt(seed=0):
    # One key/value head: multi-query attention over caches that grow.
    model = GPT(
        vocabulary_size=V, max_sequence_length=MAX_LENGTH, num_layers=2, num_heads=4,
        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
    )
    model.build((None, None))
    return _randomized(model, seed)


def _recomputed_greedy(model, prompt, max_new_tokens):
    """Greedy decoding by a full pass per new token, at one padded shape."""
    batch, length = prompt.shape
    ids = np.zeros((batch, MAX_LENGTH), "int32")
    ids[:, :length] = prompt
    for position in range(length, length + max_new_tokens):
        logits = harness.to_numpy(model(ids))  # (B, L, V); later positions unseen
        ids[:, position] = logits[:, position - 1].argmax(-1)
    return ids[:, : length + max_new_tokens]


# The phases.


def test_windows_grow_by_half_from_the_first_one_above_the_start():
    assert cache_windows.FIRST_WINDOW == 64
    assert cache_windows.lengths(16, 64) == (64,)  # one phase up to the first window
    assert cache_windows.lengths(0, 40) == (40,)
    assert cache_windows.lengths(16, 512) == (64, 96, 128, 192, 256, 384, 512)
    assert cache_windows.lengths(16, 300) == (64, 96, 128, 192, 256, 300)
    # A prompt past the first window: the first phase holds it and one step.
    assert cache_windows.lengths(64, 512) == (96, 128, 192, 256, 384, 512)
    assert cache_windows.lengths(200, 257) == (256, 257)
    # No step reads more than 1.5 times its position (past the first window).
    windows = cache_windows.lengths(0, 4096)
    for position in range(64, 4096):
        assert next(w for w in windows if w > position) <= 1.5 * position


def _translation_caches(batch, length):
    """A translation model's caches: per block a self cache that grows,
    a cross cache and a source mask that do not."""
    self_caches = tuple(kv_cache.empty(batch, length, 2, 4, "float32") for _ in range(2))
    cross = tuple(keras.ops.ones((batch, 2, 5, 2, 4)) for _ in range(2))
    return self_caches, cross, keras.ops.ones((batch, 5), "bool")


def test_plan_finds_the_leaves_that_grow():
    caches, phases = cache_windows.Phases.plan(_translation_caches, 3, 10, 150)
    assert phases.lengths == (64, 96, 128, 150)
    assert phases.axes == (2, 2, None, None, None)
    assert tuple(caches[0][0].shape) == (3, 2, 64, 2, 4)
    # Grown: the self caches padded with zeros, the others as they were.
    written = keras.ops.ones((3, 2, 64, 2, 4))
    grown = phases.grow(((written, written), caches[1], caches[2]), 96)
    self_cache = harness.to_numpy(grown[0][1])
    assert self_cache.shape == (3, 2, 96, 2, 4)
    assert np.all(self_cache[:, :, :64] == 1) and np.all(self_cache[:, :, 64:] == 0)
    assert tuple(grown[1][0].shape) == (3, 2, 5, 2, 4)
    assert tuple(grown[2].shape) == (3, 5)


@pytest.mark.parametrize(
    "empty_caches",
    [
        # A leaf that grows by another amount than the length.
        lambda batch, length: keras.ops.zeros((batch, length + 3)),
        # A leaf that grows along two axes.
        lambda batch, length: keras.ops.zeros((batch, length, length)),
    ],
    ids=["length_and_three", "two_axes"],
)
def test_plan_keeps_one_phase_for_caches_it_cannot_grow(empty_caches):
    caches, phases = cache_windows.Phases.plan(empty_caches, 1, 0, 200)
    assert phases.lengths == (200,)
    assert caches.shape[1] in (203, 200)


def test_plan_keeps_one_phase_when_not_windowed_or_short():
    _, phases = cache_windows.Phases.plan(_translation_caches, 1, 0, 200, windowed=False)
    assert phases.lengths == (200,)
    caches, phases = cache_windows.Phases.plan(_translation_caches, 1, 0, 64)
    assert phases.lengths == (64,) and caches[0][0].shape[2] == 64


def test_default_windows_follow_the_backend():
    # A compiled loop reads its whole cache; torch's eager step reads the
    # written slots only, so windows would only cost it copies.
    assert backend.preferences().cache_windows == (BACKEND in ("tensorflow", "jax"))


# Generation in phases equals generation in one phase.


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_in_phases_equals_one_phase_and_recomputing(phases_seen, monkeypatch, batch):
    # A prompt of 10 is past the first window (8): phases of 12, 16 and 24.
    prompt = np.random.default_rng(1).integers(0, V, (batch, 10)).astype("int32")
    windowed = _gpt().generate(prompt, max_new_tokens=14)
    assert phases_seen == [(12, 16, 24)]
    _one_phase(monkeypatch)
    single = _gpt().generate(prompt, max_new_tokens=14)
    assert phases_seen[-1] == (24,)
    np.testing.assert_array_equal(windowed, single)
    np.testing.assert_array_equal(windowed, _recomputed_greedy(_gpt(), prompt, 14))


@pytest.mark.parametrize(
    "kwargs",
    [dict(sampling="random", temperature=2.0), dict(sampling="top_p", top_p=0.9)],
    ids=["random", "top_p"],
)
def test_seeded_sampling_in_phases_equals_one_phase(phases_seen, monkeypatch, kwargs):
    prompt = np.random.default_rng(2).integers(0, V, (2, 3)).astype("int32")
    windowed = _gpt().generate(prompt, max_new_tokens=20, seed=5, **kwargs)
    assert phases_seen == [(8, 12, 16, 23)]
    _one_phase(monkeypatch)
    np.testing.assert_array_equal(
        windowed, _gpt().generate(prompt, max_new_tokens=20, seed=5, **kwargs)
    )


def test_ragged_prompts_and_stops_in_later_phases_equal_one_phase(phases_seen, monkeypatch):
    """Prompts that end in the first and the second phase; stop tokens first
    generated in later phases end the rows there, and with every row stopped
    the loop skips the phase left."""
    lengths, max_new_tokens = np.array([3, 9, 6]), 12
    prompts = np.random.default_rng(3).integers(0, V, (3, 9)).astype("int32")
    mask = np.arange(9)[None] < lengths[:, None]  # (B, P)
    _one_phase(monkeypatch)
    free = _gpt().generate(prompts, max_new_tokens, prompt_padding_mask=mask)
    # Per row, a token it generates at positions 9 to 15 (the phases of 12
    # and 16) that no row generates before.
    early = {t for row, n in zip(free, lengths) for t in row[n:9].tolist()}
    stops = sorted({
        next(t for t in row[9 : n + max_new_tokens].tolist() if t not in early)
        for row, n in zip(free, lengths)
    })
    pad = V - 1
    monkeypatch.setattr(cache_windows, "FIRST_WINDOW", 8)
    kwargs = dict(prompt_padding_mask=mask, stop_token_ids=stops, pad_token_id=pad)
    windowed = _gpt().generate(prompts, max_new_tokens, **kwargs)
    assert phases_seen[-1] == (8, 12, 16, 21)
    _one_phase(monkeypatch)
    np.testing.assert_array_equal(windowed, _gpt().generate(prompts, max_new_tokens, **kwargs))
    for row, free_row, n in zip(windowed, free, lengths):
        stopped = 9 + np.flatnonzero(np.isin(free_row[9:], stops))[0]
        assert stopped < 16
        np.testing.assert_array_equal(row[: stopped + 1], free_row[: stopped + 1])
        assert np.all(row[stopped + 1 :] == pad)


def _translator(seed=0):
    model = Seq2SeqTransformer(
        13, 11, 8, 14, num_encoder_layers=1, num_decoder_layers=2, num_heads=2,
        hidden_dim=8, intermediate_dim=16, dropout=0.0,
    )
    model.build()
    return _randomized(model, seed)


@pytest.mark.parametrize("sampling", ["greedy", "beam"])
def test_translation_in_phases_equals_one_phase(phases_seen, monkeypatch, sampling):
    """Greedy with its scores, and beam search: the self caches grow, the
    cross caches and the source mask stay as they are."""
    sources = np.array([[4, 5, 6, 7, 8, 9], [10, 3, 12, 0, 0, 0]], "int32")
    kwargs = dict(
        max_new_tokens=12, start_token_id=1, end_token_id=2, sampling=sampling,
        return_scores=True, num_return_sequences=2 if sampling == "beam" else 1,
    )
    ids, scores = _translator().generate(sources, **kwargs)
    assert phases_seen == [(8, 12, 13)]
    _one_phase(monkeypatch)
    single_ids, single_scores = _translator().generate(sources, **kwargs)
    np.testing.assert_array_equal(ids, single_ids)
    np.testing.assert_allclose(scores, single_scores, rtol=1e-5, atol=1e-5)
