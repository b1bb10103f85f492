"""Beam search over a model's cached step.

Shape legend: `B` batch (sources), `K` beams, `V` vocabulary size, `P`
prompt length, `L` total length (the prompt and the new tokens).

Every hypothesis of a source starts with its prompt: a translation's start
token (`P = 1`) or a language model's prompt. The positions before the
shortest prompt's last are in the caches already (the caller's prefill); the
loop starts at the shortest prompt's last position, which it runs through
the step as it runs every later token. A longer prompt's further tokens are
given, as in `generation.decode`: at those positions its one open hypothesis
takes the prompt's token, with no log-probability added, and its new tokens
start after its own prompt. `num_beams` hypotheses per source grow one token at
a time. Each step scores every extension of every open hypothesis,
`log p(prefix) + log p(token)` (the prefix's new tokens only: the prompt is
given), and keeps the best `2K` candidates: those that end with a stop token
join the finished hypotheses (the best `K` are kept, ranked by
`sum log p / length ** length_penalty`, where `length` counts the new tokens,
the stop token included), the best `K` others stay open. A source is done
when no open hypothesis can still beat its `K`-th finished one: their log
probability only falls as they grow, so for `length_penalty >= 0` the best
an open hypothesis can reach is its score at the longest length, and for a
negative penalty its score one token later. At the last position every open
hypothesis is finished as it stands. A source that is done is frozen, so a
batch decodes as each source would alone.

The caches hold `B K` rows (row `b K + k` is beam `k` of source `b`) and are
reordered after each step to follow the hypotheses that survive: every leaf
by default, or what the model's `reorder` takes (parts that are the same for
every beam of a source, such as a translation model's cross-attention keys
and values, need no reordering: a hypothesis only ever moves within its
source's rows).
"""

import keras
from keras import ops

from keras_attention.models import cache_windows
from keras_attention.models import sampling

NEGATIVE = -1e30  # a finite "minus infinity": arithmetic on it stays finite


def take_rows(caches, rows):
    """Every leaf of `caches` at `rows` `(B K,)` of its axis 0."""
    return keras.tree.map_structure(lambda cache: ops.take(cache, rows, axis=0), caches)


def beam_search(
    step, caches, prompt, total, *, num_beams, stop, pad_token_id,
    length_penalty, reorder=take_rows, phases=None, excluded=None,
    lengths=None, start=None,
):
    """The `K` best hypotheses per source and their scores.

    Args:
        step: `step(token_ids, caches, index) -> (logits, caches)` for
            `(B K, 1)` tokens at position `index`.
        caches: the caches the step starts from, holding the positions
            `0 .. start - 2`: by default `B K` rows on axis 0 of every leaf;
            any layout the step and `reorder` agree on.
        prompt: int32 `(B, P)`, the head of every hypothesis of a source
            (its first `lengths` tokens where `lengths` is given).
        total: int, `P + max_new_tokens`.
        num_beams: `K`.
        stop: static tuple of ids that end a hypothesis (may be empty).
        pad_token_id: int, written after a stop token.
        length_penalty: float, the exponent of the length in the ranking.
        reorder: `reorder(caches, rows) -> caches`, the caches following the
            hypotheses that survive a step (`rows` `(B K,)`, each within its
            source's rows).
        phases: the loop's `cache_windows.Phases` (`caches` are then for
            the first phase's length); by default one phase over `caches`
            of length `L`.
        excluded: optional id never chosen (`generation.decode`'s).
        lengths: optional int32 `(B,)`, each source's prompt length (right
            padding; ragged prompts); each source gets `L - P` new tokens
            after its prompt, then `pad_token_id`. None: every prompt is `P`
            long.
        start: static int, the shortest prompt's length (`P` by default).

    Returns:
        `(sequences, scores)`: int32 `(B, K, L)` best first, and float32
        `(B, K)`.
    """
    beams = num_beams
    batch, prompt_length = prompt.shape
    ragged = lengths is not None
    first = (prompt_length if start is None else start) - 1  # the loop's first position
    positions = ops.arange(total, dtype="int32")  # (L,)
    padding = ops.full((batch, total - prompt_length), pad_token_id, "int32")
    heads = ops.concatenate([ops.cast(prompt, "int32"), padding], axis=1)  # (B, L)
    if ragged:
        heads = ops.where(positions < lengths[:, None], heads, pad_token_id)
        # Each source's first (the position before its first new token)
        # and last written position.
        starts = lengths - 1  # (B,)
        limits = lengths + (total - prompt_length - 1)  # (B,)
    sequences = ops.repeat(heads[:, None], beams, axis=1)  # (B, K, L)
    # Only the first beam is open at the start: the others would repeat it.
    log_prob = ops.concatenate(
        [ops.zeros((batch, 1)), ops.full((batch, beams - 1), NEGATIVE)], axis=1
    )  # (B, K)
    finished = ops.copy(sequences)  # (B, K, L)
    finished_scores = ops.full((batch, beams), NEGATIVE)  # (B, K)
    done = ops.zeros((batch,), "bool")
    last = total - 1  # the last position a token is written at
    offsets = ops.arange(batch, dtype="int32")[:, None] * beams  # (B, 1)
    penalty = float(length_penalty)
    stop_ids = ops.convert_to_tensor(list(stop), "int32") if stop else None

    def condition(i, sequences, log_prob, finished, finished_scores, caches, done):
        return ops.logical_and(i < last, ops.logical_not(ops.all(done)))

    def body(i, sequences, log_prob, finished, finished_scores, caches, done):
        tokens = ops.reshape(ops.take(sequences, i, axis=2), (batch * beams, 1))
        logits, caches = step(tokens, caches, i)  # (B K, 1, V)
        logits = ops.cast(logits[:, -1], "float32")
        vocabulary = logits.shape[-1]
        # The model's log-probabilities; an excluded token is never chosen.
        token_log_prob = ops.reshape(
            sampling.exclude(ops.log_softmax(logits, axis=-1), excluded, NEGATIVE),
            (batch, beams, vocabulary),
        )
        if ragged:
            # Inside a longer prompt: its token, at no cost.
            given = i + 1 < lengths  # (B,)
            prompt_token = ops.take(heads, i + 1, axis=1)  # (B,)
            forced = ops.where(
                ops.arange(vocabulary, dtype="int32") == prompt_token[:, None, None],
                0.0,
                NEGATIVE,
            )  # (B, 1, V)
            token_log_prob = ops.where(given[:, None, None], forced, token_log_prob)
        candidates = ops.reshape(
            log_prob[:, :, None] + token_log_prob, (batch, beams * vocabulary)
        )  # (B, K V)
        width = min(2 * beams, beams * vocabulary)
        values, flat = ops.top_k(candidates, width)  # (B, 2K)
        source_beam = flat // vocabulary
        token = ops.cast(flat % vocabulary, "int32")
        grown = ops.take_along_axis(sequences, source_beam[:, :, None], axis=1)
        grown = ops.where(positions == i + 1, token[:, :, None], grown)  # (B, 2K, L)
        grown = ops.cast(grown, "int32")
        if ragged:
            # The new tokens so far per source (at least 1 where the tokens
            # are still the prompt's: no score is made there).
            length = ops.cast(ops.maximum(i + 1 - starts, 1), "float32")[:, None]  # (B, 1)
            closes = (i + 1 >= limits)[:, None]  # (B, 1)
        else:
            length = ops.cast(i + 1 - first, "float32")  # the new tokens
            closes = i + 1 >= last
        if stop_ids is None:
            ends = ops.zeros_like(token, "bool")
        else:
            ends = ops.any(token[:, :, None] == stop_ids, axis=-1)  # (B, 2K)
            if ragged:
                ends = ops.logical_and(ends, ops.logical_not(given[:, None]))
        closing = ops.logical_or(ends, closes)  # the last position closes all
        candidate_scores = ops.where(
            ops.logical_and(closing, values > NEGATIVE / 2),
            values / length**penalty,
            NEGATIVE,
        )  # (B, 2K)
        pool = ops.concatenate([finished_scores, candidate_scores], axis=1)
        new_scores, picked = ops.top_k(pool, k=beams)  # (B, K)
        pool_sequences = ops.concatenate([finished, grown], axis=1)
        new_finished = ops.take_along_axis(pool_sequences, picked[:, :, None], axis=1)
        # The best K candidates that did not end stay open.
        open_values = ops.where(ends, NEGATIVE, values)
        new_log_prob, kept = ops.top_k(open_values, k=beams)  # (B, K)
        new_sequences = ops.take_along_axis(grown, kept[:, :, None], axis=1)
        rows = ops.reshape(
            ops.take_along_axis(source_beam, kept, axis=1) + offsets, (-1,)
        )  # (B K,): the row each surviving hypothesis grew from
        caches = reorder(caches, rows)
        # Done: no open hypothesis can beat the K-th finished one any more.
        if penalty >= 0:
            best_length = float(total - prompt_length) ** penalty
        else:
            best_length = (length + 1) ** penalty
        best_open = ops.max(new_log_prob / best_length, axis=1)  # (B,)
        now_done = new_scores[:, -1] >= best_open
        if stop_ids is None:
            now_done = ops.zeros_like(now_done)
        frozen = done[:, None]
        finished_scores = ops.where(frozen, finished_scores, new_scores)
        finished = ops.where(frozen[:, :, None], finished, new_finished)
        sequences = ops.where(frozen[:, :, None], sequences, new_sequences)
        log_prob = ops.where(frozen, log_prob, new_log_prob)
        done = ops.logical_or(done, ops.logical_and(now_done, new_scores[:, -1] > NEGATIVE / 2))
        if ragged:
            # A source at its last position has closed every hypothesis.
            done = ops.logical_or(done, closes[:, 0])
        return i + 1, sequences, log_prob, finished, finished_scores, caches, done

    i = ops.convert_to_tensor(first, "int32")
    phases = phases or cache_windows.Phases.single(total)
    _, _, _, finished, finished_scores, _, _ = phases.while_loop(
        condition,
        body,
        (i, sequences, log_prob, finished, finished_scores, caches, done),
        caches_at=5,
    )
    return finished, finished_scores
