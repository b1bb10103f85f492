"""The generation core: prompts in, tokens out, for any model that gives a step.

Shape legend: `B` batch, `P` prompt length, `V` vocabulary size, `L` total
length (prompt and new tokens).

A model supplies a *step*, `step(token_ids, caches, index) -> (logits,
caches)`, which runs `T` tokens at positions `index .. index + T - 1`
through its layers with their KV caches, and the empty caches to start from.
`Generator` owns everything else, written once for every model:

- the arguments' checks (`sampling`, `temperature`, `top_k`, `top_p`, stop
  and pad ids, ragged prompts given by a padding mask, beams and returned
  sequences), and the dispatch between the token-by-token loop and beam
  search (`Generator.run`);
- prefill: the shortest prompt runs through the step at once (a one-token
  prompt, as a translation's start token, through the loop's own step);
- the decoding loop (`ops.while_loop`): each step samples a token
  (`sampling.next_token`: greedy, random, top-k, top-p, stateless noise
  keyed by `(seed, position)`), keeps prompt tokens where a longer prompt
  still has them, ends rows at a stop token or their length, and extends
  the caches by one token;
- under a compiler, the loop in phases over caches that grow
  (`cache_windows`), so that a step reads the window of slots above its
  position rather than the whole length;
- beam search (`beam_search`) from the same prompts: the prompt but its
  last token prefilled once per source, the beams' loop from its last
  position (a translation's start token alone: no prefill);
- the compilation per backend (`backend.compile_decoding`: one `jax.jit`,
  `tf.function` with XLA, or on torch an eager loop without autograd),
  made once per sampling configuration and total length and kept. Every
  call reads the weights the variables hold then.

The step is the model's own layers, always: whatever a user's subclass of a
block or an attention layer overrides takes effect in `generate` as in the
model's call.
"""

import numpy as np

import keras
from keras import ops

from keras_attention import _validation
from keras_attention import backend
from keras_attention.layers import _direct_calls
from keras_attention.models import _generation_args
from keras_attention.models import beam_search as beam_search_lib
from keras_attention.models import cache_windows
from keras_attention.models import sampling as sampling_lib


def decode(
    step, caches, ids, in_prompt, limits, seed, temperature, top_p,
    *, sampling, top_k, stop, pad_token_id, start, vocabulary_size, with_scores=False,
    phases=None, excluded=None,
):
    """The decoding loop, in `keras.ops`.

    Args:
        step: the model's step, for the prompt and then one token at a time.
        caches: the empty caches the step starts from (for the first
            phase's length).
        ids: int32 `(B, L)`, prompts then `pad_token_id`.
        in_prompt: bool `(B, L)`, where `ids` holds a prompt token.
        limits: int32 `(B,)`, each row's total length.
        seed, temperature, top_p: scalars (tensors under a compiler; for
            greedy decoding, which reads none of them, plain numbers).
        sampling, top_k, stop, pad_token_id, start: static: the sampling
            configuration, stop ids, the pad id, the shortest prompt.
        with_scores: also return, per row, the sum of the log-probabilities
            of its new tokens (the stop token included) and their number.
        phases: the loop's `cache_windows.Phases`; by default one phase
            over `caches` of length `L`.
        vocabulary_size: `V`, static.
        excluded: optional static id that is never chosen (a model's pad
            id, which its forward pass reads as padding); the scores are
            still the model's own log-probabilities.

    Returns:
        int32 `(B, L)`; with `with_scores`, then float32 `(B,)` and int32
        `(B,)`.
    """
    ids = ops.convert_to_tensor(ids, "int32")
    batch, total = ids.shape[0], ids.shape[1]
    if start == 1:
        # A one-token prompt (a translation's start token) runs through the
        # loop's own step: the loop starts at position 0, whose token is the
        # prompt's (the logits it would be chosen from are never read). The
        # layers' path stays out of the compiled program, and the step is
        # compiled once, not also before the loop: in the benchmark's
        # alternation with KerasHub, where each call starts cold, the smaller
        # program made a 32-token translation faster at batch 1 and 4
        # (benchmarks/seq2seq_speed.py).
        i = ops.convert_to_tensor(0, "int32")
        next_logits = ops.zeros((batch, vocabulary_size), "float32")
    else:
        i = ops.convert_to_tensor(start, "int32")
        logits, caches = step(ids[:, :start], caches, 0)
        next_logits = ops.cast(logits[:, -1], "float32")  # (B, V)
    done = ops.zeros((batch,), "bool")
    pad = ops.full((batch,), pad_token_id, "int32")
    stop_ids = ops.convert_to_tensor(list(stop), "int32") if stop else None
    # The scores ride in the loop only when asked for: a constant that a
    # loop passes on unchanged breaks TensorFlow's XLA bridge from the third
    # loop of a function on (the phases; tensorflow/tensorflow#122886).
    scores = ()
    if with_scores:
        scores = (ops.zeros((batch,), "float32"), ops.zeros((batch,), "int32"))

    def choose(i, ids, next_logits, done, scores):
        """The token at position `i` of each row, written into `ids`."""
        sampled = sampling_lib.next_token(
            sampling_lib.exclude(next_logits, excluded), sampling, temperature, top_k, top_p, seed, i
        )  # (B,)
        given = ops.take(ids, i, axis=1)  # (B,) prompt token or padding
        from_prompt = ops.take(in_prompt, i, axis=1)  # (B,)
        token = ops.where(from_prompt, given, sampled)
        finished = ops.logical_or(done, i >= limits)
        token = ops.where(finished, pad, token)
        if with_scores:
            log_prob, count = scores
            new = ops.logical_not(ops.logical_or(finished, from_prompt))  # (B,)
            token_log_prob = ops.take_along_axis(
                ops.log_softmax(ops.cast(next_logits, "float32"), axis=-1),
                token[:, None],
                axis=-1,
            )[:, 0]  # (B,)
            scores = (
                log_prob + ops.where(new, token_log_prob, 0.0),
                count + ops.cast(new, "int32"),
            )
        if stop_ids is not None:
            stopped = ops.any(token[:, None] == stop_ids[None, :], axis=-1)
            stopped = ops.logical_and(stopped, ops.logical_not(from_prompt))
            finished = ops.logical_or(finished, stopped)
        done = ops.logical_or(finished, i + 1 >= limits)
        ids = ops.slice_update(ids, (0, i), token[:, None])
        return token, ids, done, tuple(scores)

    # The loop steps through positions `start .. L - 2`; the last token is
    # chosen after it, without a step whose logits nothing would read (a
    # thirty-second of a 32-token translation).
    def condition(i, ids, caches, next_logits, done, *scores):
        return ops.logical_and(i < total - 1, ops.logical_not(ops.all(done)))

    def body(i, ids, caches, next_logits, done, *scores):
        token, ids, done, scores = choose(i, ids, next_logits, done, scores)
        logits, caches = step(token[:, None], caches, i)
        return (i + 1, ids, caches, ops.cast(logits[:, -1], "float32"), done) + scores

    phases = phases or cache_windows.Phases.single(total)
    i, ids, _, next_logits, done, *scores = phases.while_loop(
        condition, body, (i, ids, caches, next_logits, done) + scores, caches_at=2
    )
    # At `L - 1`, or where every row was done (each then gets padding).
    _, ids, _, scores = choose(i, ids, next_logits, done, tuple(scores))
    if with_scores:
        return (ids,) + tuple(scores)
    return ids


def layout(prompt, lengths, total, pad_token_id):
    """The loop's `(ids, in_prompt, limits)` (`decode`) for int32 prompts
    `(B, P)` whose rows hold `lengths` `(B,)` tokens, continued to `total`
    positions."""
    batch, prompt_length = prompt.shape
    padding = ops.full((batch, total - prompt_length), pad_token_id, "int32")
    ids = ops.concatenate([prompt, padding], axis=1)  # (B, L)
    in_prompt = ops.arange(total, dtype="int32")[None, :] < lengths[:, None]  # (B, L)
    limits = lengths + (total - prompt_length)  # (B,)
    return ids, in_prompt, limits


class Generator:
    """Cached, compiled generation for one model.

    Args:
        step: `step(token_ids, caches, index) -> (logits, caches)` through
            the model's layers.
        empty_caches: `empty_caches(batch, length, *context)`, the caches
            `step` starts from; `context` are the model's own arrays given to
            `generate` (a translation model's source ids and mask).
        variables: a function returning the model's variables (read when a
            loop is compiled).
        vocabulary_size: int, the ids a token may take.
        max_length: int, the longest prompt plus new tokens.
        max_length_name: the model's name for `max_length`, for messages.
        reorder_caches: optional `reorder_caches(caches, rows) -> caches`
            for beam search (`beam_search.beam_search`'s `reorder`); by
            default every leaf follows the surviving hypotheses.
        pad_is_padding: whether the model's forward pass reads the pad id
            as padding (a translation model's decoder mask): the pad id is
            then never generated, so that the model's full pass scores a
            generated sequence as `return_scores` says.
        jit_compile: a function returning whether the model asks for its
            backend's compiler (`compile(jit_compile=True)`), read at each
            call: where the loop runs eagerly (torch), its one-token step is
            then compiled on its own (`backend.compile_step`).
    """

    def __init__(
        self, step, empty_caches, variables, vocabulary_size, max_length,
        max_length_name="max_sequence_length", reorder_caches=None, pad_is_padding=False,
        jit_compile=lambda: False,
    ):
        self.step = step
        self.empty_caches = empty_caches
        self.variables = variables
        self.vocabulary_size = vocabulary_size
        self.max_length = max_length
        self.max_length_name = max_length_name
        self.reorder_caches = reorder_caches or beam_search_lib.take_rows
        self.pad_is_padding = bool(pad_is_padding)
        self.jit_compile = jit_compile
        self._compiled_step = None
        self._functions = {}

    def check_token(self, name, token):
        """Raises unless `token` is an id of the vocabulary; returns it."""
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not (
            0 <= token < self.vocabulary_size
        ):
            raise ValueError(
                f"`{name}` must be an id in [0, {self.vocabulary_size}). "
                f"Received: {name}={token!r}"
            )
        return int(token)

    def generate(
        self, prompt, max_new_tokens, sampling="greedy", temperature=1.0, top_k=None, top_p=None,
        seed=None, stop_token_ids=None, prompt_padding_mask=None, pad_token_id=0, context=(),
        return_scores=False, length_penalty=1.0,
    ):
        """`prompt` int numpy `(B, P)` (checked by the model) continued by
        `max_new_tokens`; the arguments of `GPT.generate`. `context`: numpy
        arrays for `empty_caches`. Returns int32 numpy `(B, P +
        max_new_tokens)`; with `return_scores`, also float32 `(B,)`: the sum
        of the new tokens' log-probabilities over `length ** length_penalty`
        (`length`: the new tokens, a stop token included)."""
        max_new_tokens = _validation.check_positive_int("max_new_tokens", max_new_tokens)
        total = self._check_total(prompt.shape[1], max_new_tokens)
        top_k = _generation_args.check_sampling(sampling, temperature, top_k, top_p)
        stop = _generation_args.check_stop(stop_token_ids, pad_token_id, self.vocabulary_size)
        seed = _validation.check_seed("seed", seed, maximum=_generation_args.SEED_LIMIT)
        if return_scores:
            length_penalty = _generation_args.check_length_penalty(length_penalty)
        # Rows of different lengths (ragged prompts) pass their lengths;
        # otherwise the loop makes them (one array fewer to convert).
        ragged = prompt_padding_mask is not None
        lengths = ()
        if ragged:
            lengths = (_generation_args.prompt_lengths(prompt, prompt_padding_mask).astype("int32"),)
        start = int(lengths[0].min()) if ragged else prompt.shape[1]  # the shortest prompt
        options = dict(
            sampling=sampling, top_k=top_k, stop=stop, pad_token_id=pad_token_id,
            start=start, with_scores=bool(return_scores),
            excluded=pad_token_id if self.pad_is_padding else None,
        )
        # Only what the mode reads is passed: each argument of a compiled
        # call costs time to convert and check, a part of a short
        # translation's time that shows on TensorFlow
        # (benchmarks/seq2seq_speed.py).
        noise = ()
        if sampling != "greedy":
            if seed is None:
                seed = int(np.random.randint(0, _generation_args.SEED_LIMIT))
            top_p = 1.0 if top_p is None else top_p
            noise = (np.int32(seed), np.float32(temperature), np.float32(top_p))
        step = self._step()

        def loop(prompt, *arguments):
            if ragged:
                lengths, *arguments = arguments
            else:
                lengths = ops.full((prompt.shape[0],), prompt.shape[1], "int32")
            # Greedy decoding reads none of the three: plain numbers stand in.
            seed, temperature, top_p = arguments[: len(noise)] or (0, 1.0, 1.0)
            context = arguments[len(noise):]
            ids, in_prompt, limits = layout(prompt, lengths, total, pad_token_id)
            caches, phases = cache_windows.Phases.plan(
                self.empty_caches, prompt.shape[0], start, total, context,
                windowed=backend.preferences().cache_windows,
            )
            return decode(
                step, caches, ids, in_prompt, limits,
                seed, temperature, top_p, phases=phases,
                vocabulary_size=self.vocabulary_size, **options,
            )

        key = ("sample", prompt.shape[0], total, ragged, step is not self.step) + tuple(
            sorted(options.items())
        )
        outputs = self._function(key, loop)(
            prompt.astype("int32", copy=False), *lengths, *noise, *context
        )
        if not return_scores:
            return _to_numpy(outputs, "int32")
        ids, log_prob, count = (_to_numpy(x) for x in outputs)
        scores = log_prob / np.maximum(count, 1).astype("float32") ** length_penalty
        return ids.astype("int32"), scores.astype("float32")

    def run(
        self,
        prompt,
        max_new_tokens,
        sampling="greedy",
        num_beams=4,
        num_return_sequences=1,
        return_scores=False,
        length_penalty=1.0,
        stop_token_ids=None,
        pad_token_id=0,
        prompt_padding_mask=None,
        context=(),
        **options,
    ):
        """`generate`, or `beam_search` for `sampling="beam"`, with the
        models' return convention.

        `options` are `generate`'s `temperature`, `top_k`, `top_p` and
        `seed`, which beam search checks as greedy decoding does and does
        not read. Returns int32 numpy `(B, P + max_new_tokens)`, or `(B,
        num_return_sequences, P + max_new_tokens)` best first when
        `num_return_sequences > 1`; with `return_scores`, also float32 `(B,)`
        (or `(B, num_return_sequences)`).
        """
        num_beams, num_return_sequences = _generation_args.check_modes(
            sampling, num_beams, num_return_sequences
        )
        arguments = dict(
            stop_token_ids=stop_token_ids, pad_token_id=pad_token_id,
            prompt_padding_mask=prompt_padding_mask, context=context,
        )
        if sampling != "beam":
            return self.generate(
                prompt, max_new_tokens, sampling=sampling, return_scores=return_scores,
                length_penalty=length_penalty, **arguments, **options,
            )
        # Beam search reads neither; they are checked as greedy decoding does.
        _generation_args.check_sampling("greedy", options.get("temperature", 1.0), None, None)
        _validation.check_seed("seed", options.get("seed"), maximum=_generation_args.SEED_LIMIT)
        sequences, scores = self.beam_search(
            prompt, max_new_tokens, num_beams=num_beams,
            length_penalty=length_penalty, **arguments,
        )
        sequences = sequences[:, :num_return_sequences]
        scores = scores[:, :num_return_sequences]
        if num_return_sequences == 1:
            sequences, scores = sequences[:, 0], scores[:, 0]
        return (sequences, scores) if return_scores else sequences

    def beam_search(
        self,
        prompt,
        max_new_tokens,
        num_beams=4,
        stop_token_ids=None,
        pad_token_id=0,
        length_penalty=1.0,
        prompt_padding_mask=None,
        context=(),
    ):
        """The `num_beams` best continuations of each prompt
        (`beam_search.beam_search`).

        Args:
            prompt: int numpy `(B, P)` (checked by the model).
            max_new_tokens, stop_token_ids, pad_token_id, context: as
                `generate`'s.
            num_beams: positive int `K`.
            length_penalty: float, the exponent of the number of new tokens
                in the ranking and the scores.
            prompt_padding_mask: optional bool `(B, P)`, as `generate`'s:
                each row's prompt is its first `True` positions, its new
                tokens follow it.

        Returns:
            int32 numpy `(B, K, P + max_new_tokens)`, best first, and their
            float32 scores `(B, K)`: the sum of the new tokens'
            log-probabilities (a stop token included) over their number
            `** length_penalty`.
        """
        max_new_tokens = _validation.check_positive_int("max_new_tokens", max_new_tokens)
        num_beams = _validation.check_positive_int("num_beams", num_beams)
        batch, prompt_length = prompt.shape
        total = self._check_total(prompt_length, max_new_tokens)
        length_penalty = _generation_args.check_length_penalty(length_penalty)
        stop = _generation_args.check_stop(stop_token_ids, pad_token_id, self.vocabulary_size)
        # Prompts of different lengths (ragged) pass their lengths, as in
        # `generate`.
        lengths = ()
        if prompt_padding_mask is not None:
            row_lengths = _generation_args.prompt_lengths(prompt, prompt_padding_mask)
            if row_lengths.min() < prompt_length:
                lengths = (row_lengths.astype("int32"),)
        start = int(lengths[0].min()) if lengths else prompt_length  # the shortest prompt
        options = dict(
            num_beams=num_beams, stop=stop, pad_token_id=pad_token_id,
            length_penalty=length_penalty, start=start,
            excluded=pad_token_id if self.pad_is_padding else None,
        )
        first = start - 1  # the beams' loop starts at the shortest prompt's last token
        ragged = bool(lengths)
        step = self._step()

        def loop(prompt, *arguments):
            lengths, context = (arguments[0], arguments[1:]) if ragged else (None, arguments)
            caches, phases = cache_windows.Phases.plan(
                self.empty_caches, batch, first, total, context,
                windowed=backend.preferences().cache_windows,
            )
            if first:
                # The prompts' common head, once per source: every beam shares it.
                _, caches = step(prompt[:, :first], caches, 0)
            # Row b K + k is beam k of source b.
            caches = keras.tree.map_structure(
                lambda cache: ops.repeat(cache, num_beams, axis=0), caches
            )
            return beam_search_lib.beam_search(
                step, caches, prompt, total, reorder=self.reorder_caches,
                phases=phases, lengths=lengths, **options,
            )

        key = ("beam", batch, prompt_length, total, ragged, step is not self.step) + tuple(
            sorted(options.items())
        )
        sequences, scores = self._function(key, loop)(
            prompt.astype("int32", copy=False), *lengths, *context
        )
        return _to_numpy(sequences, "int32"), _to_numpy(scores, "float32")

    def _check_total(self, prompt_length, max_new_tokens):
        total = prompt_length + max_new_tokens
        if total > self.max_length:
            raise ValueError(
                "The prompt and the new tokens must fit in "
                f"{self.max_length_name}={self.max_length}. Received: "
                f"prompt length {prompt_length} + max_new_tokens={max_new_tokens} "
                f"= {total}"
            )
        return total

    def _step(self):
        """The step the loops call: compiled on its own where the model asks
        for a compiler and the backend runs the loop eagerly, made once."""
        if not self.jit_compile():
            return self.step
        if self._compiled_step is None:
            self._compiled_step = backend.compile_step(self.step)
        return self._compiled_step

    def _function(self, key, loop):
        """The compiled `loop` for one configuration (its step computing
        `rows` rows), made once."""
        if key not in self._functions:
            if backend.preferences().direct_calls:
                loop = _with_direct_calls(loop)
            self._functions[key] = backend.compile_decoding(loop, self.variables())
        return self._functions[key]


def model_generator(
    model, step, empty_caches, vocabulary_size, max_length_name="max_sequence_length", **options
):
    """`model`'s `Generator`, made at the first call and kept as
    `model._generator`; `Generator`'s arguments, but that the variables
    are the model's, `max_length` the model's attribute named
    `max_length_name`, and `jit_compile` the model's `compile()` argument.
    `options`: `Generator`'s other arguments."""
    if model._generator is None:
        model._generator = Generator(
            step, empty_caches, lambda: model.variables, vocabulary_size,
            getattr(model, max_length_name), max_length_name,
            jit_compile=lambda: getattr(model, "jit_compile", False) is True, **options,
        )
    return model._generator


def _with_direct_calls(loop):
    """`loop` with its layers called through their own `call` where Keras's
    wrapper would add nothing (`layers/_direct_calls.py`)."""

    def function(*args):
        with _direct_calls.inference():
            return loop(*args)

    return function


def _to_numpy(x, dtype=None):
    x = _validation.to_numpy(x)
    return x if dtype is None else x.astype(dtype, copy=False)
