"""Tests of `GPT`'s decoding: beam search against brute force (GPT-2 and
LLaMA configurations), and cached decoding against the full pass for every
block option.

Shape legend: `B` batch, `T` length, `P` prompt length, `N` new tokens, `V`
vocabulary size, `K` beams, `R` returned sequences.

The references are the model's own full passes: beam search's hypotheses and
scores against every continuation scored by one full pass, cached logits and
greedy decoding against full passes recomputed at every length. Each full
pass runs at one padded shape (`_forward`), so that JAX compiles its eager
ops once per model.
"""

import itertools
import re

import keras
import numpy as np
import pytest

import harness
from keras_attention.layers import TransformerDecoderStack
from keras_attention.models import GPT

MAX_LENGTH = 8
BLOCKS = dict(num_layers=2, num_heads=4, hidden_dim=16, intermediate_dim=24)
LLAMA = dict(
    normalization="rms_norm", positions="rotary", gated_feedforward=True,
    activation="silu", use_bias=False, num_key_value_heads=1, tie_weights=False,
)


def _gpt(vocabulary_size, seed=0, cls=GPT, **kwargs):
    model = cls(vocabulary_size, MAX_LENGTH, **{**BLOCKS, **kwargs})
    model.build((None, None))
    return harness.randomize_weights(model, seed, embedding_scale=0.5)


def _forward(model, ids, rows=None):
    return harness.padded_logits(model, ids, rows or ids.shape[0], MAX_LENGTH)


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _greedy_reference(model, prompt, max_new_tokens):
    return harness.greedy_reference(model, prompt, max_new_tokens, 4, MAX_LENGTH)


# Beam search against brute force.

V, NEW = 5, 3  # 125 continuations; 25 = V ** (NEW - 1) beams keep every prefix
BEAMS = V ** (NEW - 1)
STOP, PAD = 2, 0
PROMPTS = np.array([[1, 3, 4], [4, 4, 0]], "int32")  # (B, P)


def _hypotheses(stop):
    """Every hypothesis of `NEW` new tokens at most: those that end at their
    first stop token and those that run `NEW` tokens, as tuples."""
    every = set()
    for tail in itertools.product(range(V), repeat=NEW):
        ends = [t for t, token in enumerate(tail) if token in stop]
        every.add(tail[: ends[0] + 1] if ends else tail)
    return sorted(every)


def _brute_force(model, prompt, stop, length_penalty):
    """`{hypothesis padded to NEW: score}` for one prompt `(P,)`, every
    hypothesis scored by one full pass: the sum of its tokens'
    log-probabilities over `length ** length_penalty`."""
    hypotheses = _hypotheses(stop)
    prompt_length = len(prompt)
    ids = np.full((len(hypotheses), prompt_length + NEW), PAD, "int32")
    ids[:, :prompt_length] = prompt
    for row, tail in enumerate(hypotheses):
        ids[row, prompt_length : prompt_length + len(tail)] = tail
    log_p = _log_softmax(_forward(model, ids))  # (rows, P + N, V)
    scores = {}
    for row, tail in enumerate(hypotheses):
        positions = np.arange(prompt_length - 1, prompt_length - 1 + len(tail))
        total = log_p[row, positions, list(tail)].sum()
        scores[tuple(ids[row, prompt_length:])] = total / len(tail) ** length_penalty
    return scores


def _check_against_brute_force(model, stop, length_penalty, mask=None):
    """Beam search over `PROMPTS` (each row's first `mask` positions with a
    mask) against every hypothesis scored by the full pass."""
    sequences, scores = model.generate(
        PROMPTS, NEW, sampling="beam", num_beams=BEAMS, num_return_sequences=BEAMS,
        stop_token_ids=stop or None, length_penalty=length_penalty, return_scores=True,
        prompt_padding_mask=mask,
    )
    batch, width = PROMPTS.shape
    lengths = [width] * batch if mask is None else mask.sum(axis=1)
    assert sequences.shape == (batch, BEAMS, width + NEW)
    assert scores.shape == (batch, BEAMS)
    for b, (prompt, length) in enumerate(zip(PROMPTS, lengths)):
        prompt = prompt[:length]
        everything = _brute_force(model, prompt, stop, length_penalty)
        ranked = sorted(everything.values(), reverse=True)
        np.testing.assert_array_equal(sequences[b, :, :length], np.tile(prompt, (BEAMS, 1)))
        # A shorter prompt's row ends in padding after its NEW tokens.
        np.testing.assert_array_equal(sequences[b, :, length + NEW :], PAD)
        # The best K, best first, each scored as the full pass says.
        np.testing.assert_allclose(scores[b], ranked[:BEAMS], rtol=1e-4, atol=1e-4)
        for sequence, score in zip(sequences[b], scores[b]):
            np.testing.assert_allclose(
                score, everything[tuple(sequence[length : length + NEW])], rtol=1e-4, atol=1e-4
            )
        assert len({tuple(s) for s in sequences[b]}) == BEAMS
    return sequences


@pytest.fixture(scope="module")
def small():
    """A GPT-2 configured model over 5 tokens, only read."""
    return _gpt(V, seed=1)


@pytest.mark.parametrize(
    "stop, length_penalty", [((), 0.0), ((STOP,), 0.7)], ids=["no_stop", "stop_token"]
)
def test_beam_search_finds_the_best_hypotheses_by_brute_force(small, stop, length_penalty):
    sequences = _check_against_brute_force(small, stop, length_penalty)
    if stop:
        # Some of the best end early, padded after their stop token.
        new = sequences[:, :, PROMPTS.shape[1] :]
        early = new[:, :, :-1] == STOP
        assert early.any()
        for row in new.reshape(-1, NEW):
            if STOP in row[:-1]:
                assert np.all(row[list(row).index(STOP) + 1 :] == PAD)


def test_beam_search_on_the_llama_configuration_by_brute_force():
    llama = _gpt(V, seed=2, **LLAMA)
    _check_against_brute_force(llama, (STOP,), 1.0)


def test_one_beam_is_greedy(small):
    greedy = small.generate(PROMPTS, 4)
    np.testing.assert_array_equal(greedy, _greedy_reference(small, PROMPTS, 4))
    beam = small.generate(PROMPTS, 4, sampling="beam", num_beams=1)
    np.testing.assert_array_equal(beam, greedy)


def test_return_shapes_and_greedy_scores(small):
    """One returned sequence per row is `(B, L)`; greedy scores (now
    returned by `GPT.generate` too) are the full pass's log-probabilities."""
    best, best_scores = small.generate(
        PROMPTS, NEW, sampling="beam", num_beams=3, return_scores=True
    )
    three = small.generate(PROMPTS, NEW, sampling="beam", num_beams=3, num_return_sequences=3)
    assert best.shape == (2, 3 + NEW) and best_scores.shape == (2,)
    assert three.shape == (2, 3, 3 + NEW) and three.dtype == np.int32
    np.testing.assert_array_equal(three[:, 0], best)
    ids, scores = small.generate(PROMPTS, NEW, return_scores=True, length_penalty=0.0)
    log_p = _log_softmax(_forward(small, ids))
    positions = np.arange(PROMPTS.shape[1] - 1, ids.shape[1] - 1)
    expected = [log_p[b, positions, ids[b, positions + 1]].sum() for b in range(2)]
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-4)


def test_a_full_prompt_mask_is_taken(small):
    kwargs = dict(sampling="beam", num_beams=2)
    np.testing.assert_array_equal(
        small.generate(PROMPTS, 2, prompt_padding_mask=np.ones(PROMPTS.shape, bool), **kwargs),
        small.generate(PROMPTS, 2, **kwargs),
    )


# Row 1's prompt is its first token: its NEW = 3 new tokens overwrite the
# padded prompt's (4, 0) and one more position, and its row ends in padding.
RAGGED = np.array([[True, True, True], [True, False, False]])


@pytest.mark.parametrize(
    "stop, length_penalty", [((), 0.0), ((STOP,), 0.7), ((STOP,), -0.5)],
    ids=["no_stop", "stop_token", "negative_penalty"],
)
def test_beam_search_over_ragged_prompts_by_brute_force(small, stop, length_penalty):
    _check_against_brute_force(small, stop, length_penalty, mask=RAGGED)


def test_ragged_beam_search_equals_each_prompt_alone(small):
    """A batch of prompts of different lengths decodes as each prompt
    would alone, a stop token given (a prompt token equal to it ends
    nothing)."""
    prompts = np.array([[STOP, 3, 1, 4], [1, STOP, 0, 0], [4, 0, 0, 0]], "int32")
    mask = np.arange(4)[None] < np.array([4, 2, 1])[:, None]
    kwargs = dict(
        sampling="beam", num_beams=3, num_return_sequences=3, stop_token_ids=[STOP],
        return_scores=True,
    )
    sequences, scores = small.generate(prompts, 3, prompt_padding_mask=mask, **kwargs)
    for b, length in enumerate(mask.sum(axis=1)):
        alone, alone_scores = small.generate(prompts[b : b + 1, :length], 3, **kwargs)
        np.testing.assert_array_equal(sequences[b, :, : length + 3], alone[0])
        np.testing.assert_array_equal(sequences[b, :, length + 3 :], PAD)
        np.testing.assert_allclose(scores[b], alone_scores[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sampling="nucleus"), r"`sampling` must be one of .*'beam'.*sampling='nucleus'"),
        (dict(sampling="beam", num_beams=0), r"`num_beams` must be a positive integer.*num_beams=0"),
        (dict(sampling="beam", num_beams=2, num_return_sequences=3), r"`num_return_sequences` must be at most `num_beams`.*num_return_sequences=3, num_beams=2"),
        (dict(num_return_sequences=2), r"`num_return_sequences`.*\(1 otherwise\).*sampling='greedy'"),
        (dict(sampling="beam", length_penalty="long"), r"`length_penalty` must be a float.*length_penalty='long'"),
        (dict(sampling="beam", stop_token_ids=[V]), rf"`stop_token_ids`.*Received: stop_token_ids={V}"),
        (dict(sampling="beam", max_new_tokens=MAX_LENGTH), re.escape(f"max_sequence_length={MAX_LENGTH}. Received: prompt length 3")),
        (dict(sampling="beam", seed=-1), r"`seed`.*seed=-1"),
    ],
    ids=["sampling", "beams", "returned", "returned_greedy", "penalty", "stop", "too_long", "seed"],
)
def test_rejects_bad_beam_arguments(small, kwargs, message):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        small.generate(PROMPTS, **kwargs)


# Cached decoding against the full pass, for every block option.


class BilinearDecoder(TransformerDecoderStack):
    """A decoder stack whose attention layers score with `Bilinear`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, score="bilinear", **kwargs)


class BilinearGPT(GPT):
    decoder_class = BilinearDecoder


OPTIONS = {
    "gpt2": {},
    "rms_norm": dict(normalization="rms_norm"),
    "rotary": dict(positions="rotary"),
    "gated": dict(gated_feedforward=True, activation="silu"),
    "gqa_1": dict(num_key_value_heads=1),
    "gqa_2": dict(num_key_value_heads=2),
    "no_bias": dict(use_bias=False),
    "untied": dict(tie_weights=False),
    "llama": LLAMA,
    "bilinear": dict(cls=BilinearGPT),
}
CACHE_V = 31


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
def test_cached_decoding_equals_the_full_pass(options):
    model = _gpt(CACHE_V, seed=3, **options)
    ids = np.random.default_rng(4).integers(0, CACHE_V, size=(2, MAX_LENGTH)).astype("int32")
    full = _forward(model, ids)
    # Token by token, then a prefill of 5 tokens and single tokens.
    for prefill in (1, 5):
        cache = model.empty_cache(2, MAX_LENGTH)
        logits, cache = model.call_with_cache(ids[:, :prefill], cache, 0)
        steps = [harness.to_numpy(logits)]
        for index in range(prefill, MAX_LENGTH):
            logits, cache = model.call_with_cache(ids[:, index : index + 1], cache, index)
            steps.append(harness.to_numpy(logits))
        # float32 sums in another order: differences of about 1e-5 at logits of
        # about 3 depend on the host's kernels; a cache error moves them by far more.
        np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4)
    prompt = ids[:, :3]
    out = model.generate(prompt, MAX_LENGTH - 3)
    np.testing.assert_array_equal(out, _greedy_reference(model, prompt, MAX_LENGTH - 3))
    assert len(np.unique(out[:, 3:])) > 1  # not one token over and over


@pytest.mark.parametrize("sampling", ["greedy", "top_k", "beam"])
def test_a_model_that_generates_before_it_is_built_trains_afterwards(sampling):
    """`generate` builds a model never built (its decoding runs without
    autograd: on torch in `torch.inference_mode`, whose tensors cannot be
    trained); then training steps update every weight and lower the loss."""
    model = GPT(V, MAX_LENGTH, **BLOCKS, dropout=0.0, seed=3)
    assert not model.built
    options = {"top_k": 2, "seed": 1} if sampling == "top_k" else {}
    model.generate(PROMPTS, NEW, sampling=sampling, **options)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    ids = np.random.default_rng(0).integers(0, V, (4, MAX_LENGTH + 1)).astype("int32")
    with harness.trains_every_weight(model, unless=("key/bias",)):
        losses = [float(model.train_on_batch(ids[:, :-1], ids[:, 1:])) for _ in range(3)]
    assert losses[-1] < losses[0]
    # And decoding still works on the trained weights.
    assert model.generate(PROMPTS, NEW).shape == (2, PROMPTS.shape[1] + NEW)
