"""Hard attention: each query selects one position instead of averaging.

Shape legend: `B` batch, `T` query length, `S` key/value length, `Dq`, `Dk`,
`Dv` feature sizes of query, key and value.

Hard and soft attention share the pipeline of `keras_attention.ops.attention`
(score -> mask -> normalize -> weighted sum); hard attention's normalize step
turns the scores into a one-hot selection (plus, in training, the surrogate
that carries the gradient of the chosen estimator).
"""

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_attention import _docs
from keras_attention import _keras_objects
from keras_attention import _signatures
from keras_attention import _validation
from keras_attention import ops as attention_ops
from keras_attention import scoring
from keras_attention._typing import Scorer
from keras_attention.layers._single_head import SingleHeadAttention
from keras_attention.layers._single_head import call_arguments

SELECTIONS = ("argmax", "sample")
_Schedule = keras.optimizers.schedules.LearningRateSchedule
ESTIMATORS = ("reinforce", "straight_through", "gumbel")


def _log_prob_argument(return_log_prob: bool = False):
    """The argument `HardAttention.call` takes besides `SoftAttention.call`'s
    (before `training`)."""


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class HardAttention(SingleHeadAttention):
    """Hard attention: each query returns the value of one selected position.

    For each query `q_t` the layer scores every key, `e_ts = s(q_t, k_s)`,
    forms the attention distribution `pi_t = softmax_s(e_ts)` (as
    `SoftAttention` does) and then, instead of averaging the values, selects
    one position `z_t`:

    - `selection="argmax"`: `z_t = argmax_s e_ts` (ties: the first position);
    - `selection="sample"`: `z_t ~ pi_t`, drawn with the Gumbel-max trick
      `z_t = argmax_s (e_ts + g_ts)`, `g_ts ~ Gumbel(0, 1)`, from the layer's
      seeded `keras.random.SeedGenerator` (reproducible with `seed`).

    The output is the selected value, `o_t = v_{z_t}`, i.e. the one-hot
    selection `h_t` times the values. A masked position is never selected; a
    query that may attend to nothing selects nothing and outputs exactly 0.

    The selection is not differentiable with respect to the scores, so the
    scorer needs one of three estimators in training (`training=True`):

    - `"reinforce"` (Williams, 1992; Mnih et al., 2014; Xu et al., 2015): the
      output carries no gradient to the scorer. Call the layer with
      `return_log_prob=True` to get, per example, the log-probability
      `log p = sum_t log pi_t(z_t)` of what it selected and the entropy
      `H = sum_t H(pi_t)` of its distributions, and train with
      `keras_attention.losses.ReinforceModel`, which adds
      `-(stop_gradient(R) - b) * log p - entropy_weight * H` to the task loss.
    - `"straight_through"` (Bengio et al., 2013): the forward pass outputs the
      hard selection exactly; the backward pass uses the gradient of the soft
      distribution `softmax(e_t / temperature)`, computed as
      `h_t + (pi_t - stop_gradient(pi_t))` (exactly `h_t` forward). With
      `temperature=1` the scorer gets the gradient soft attention would give
      it for the same upstream gradient.
    - `"gumbel"` (Jang et al., 2017; Maddison et al., 2017): the Gumbel-softmax
      sample `y_t = softmax((e_t + g_t) / temperature)` relaxes the sampled
      one-hot `h_t = onehot(argmax(e_t + g_t))`. With `hard=False` the output
      is `y_t V` (soft, approaching one-hot as the temperature falls); with
      `hard=True` it is exactly `h_t V` and the gradient is that of `y_t`
      (straight-through Gumbel). Gumbel always samples, so it needs
      `selection="sample"`.

    At inference (`training` false or `None`) every estimator outputs the hard
    selection `h_t V`, by default of the argmax (deterministic);
    `inference_selection="sample"` samples instead.

    `temperature` may be annealed: pass a
    `keras.optimizers.schedules.LearningRateSchedule` (for instance
    `PolynomialDecay(1.0, 10_000, end_learning_rate=0.5)`); it is evaluated at
    the layer's `iterations`, a non-trainable counter of its training calls
    that is saved with the model.

    Masks are boolean, `True` = may attend (see `keras_attention.masking`) and
    combine with AND, as in `SoftAttention`. The query's Keras mask
    propagates to the output; the masks of the inputs are never changed.

    Args:
        score: the scoring function: `"scaled_dot"` (default), `"dot"`,
            `"additive"`, `"bilinear"`, a `keras_attention.scoring.Scorer`
            instance or a scorer config.
        selection: `"sample"` (default) or `"argmax"`, how a position is
            chosen in training. REINFORCE's gradient estimate is unbiased
            only for `"sample"`; with `"argmax"` it is a greedy, biased
            variant.
        estimator: `"reinforce"` (default), `"straight_through"` or
            `"gumbel"`, how the scorer gets a gradient in training.
        temperature: positive float or a
            `keras.optimizers.schedules.LearningRateSchedule`, the temperature
            of the relaxation used by `"straight_through"` and `"gumbel"`.
            Defaults to 1. `"reinforce"` samples from `pi` itself and takes
            no temperature.
        seed: optional int, the seed of the sampling.
        hard: bool, for `"gumbel"` only: output the one-hot sample
            (straight-through Gumbel) instead of the relaxed sample. The other
            estimators always output the one-hot selection. Defaults to False.
        inference_selection: `"argmax"` (default) or `"sample"`, how a
            position is chosen at inference.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        {single_head_call_inputs}
        use_causal_mask: bool, query `t` may select only keys
            `0 .. S - T + t` (bottom-right aligned when `T != S`).
        return_attention_scores: bool, also return the attention
            distribution `pi` and the one-hot selection `h`.
        return_log_prob: bool, also return `log p` and `H`, each `(B,)` in
            float32 (also under mixed precision, as REINFORCE multiplies them
            by rewards): the log-probability of the selection and the entropy
            of the distribution, summed over the queries. A query that may
            attend to nothing contributes 0 to both.
        training: bool, whether the estimator's training behaviour is on.

    Returns:
        `output` of shape `(B, T, Dv)`; with `return_attention_scores=True`,
        `(output, probabilities, selection)`, each of the last two
        `(B, T, S)`; with `return_log_prob=True`, `log_prob` and `entropy`
        follow: `(output, log_prob, entropy)` or
        `(output, probabilities, selection, log_prob, entropy)`.

    Example:

    >>> import numpy as np
    >>> layer = HardAttention(score="dot", seed=0)
    >>> query = np.random.rand(2, 3, 8).astype("float32")
    >>> value = np.random.rand(2, 5, 8).astype("float32")
    >>> output, probabilities, selection = layer(
    ...     query, value, return_attention_scores=True
    ... )
    >>> tuple(output.shape), tuple(selection.shape)
    ((2, 3, 8), (2, 3, 5))
    >>> np.asarray(selection).sum(-1)  # one position per query
    array([[1., 1., 1.],
           [1., 1., 1.]], dtype=float32)

    References:
        - [Williams, 1992](https://doi.org/10.1007/BF00992696) (REINFORCE)
        - [Bengio et al., 2013](https://arxiv.org/abs/1308.3432)
          (straight-through)
        - [Mnih et al., 2014](https://arxiv.org/abs/1406.6247)
        - [Xu et al., 2015](https://arxiv.org/abs/1502.03044)
        - [Jang et al., 2017](https://arxiv.org/abs/1611.01144)
        - [Maddison et al., 2017](https://arxiv.org/abs/1611.00712)
    """

    def __init__(
        self, score: Scorer = "scaled_dot", selection: str = "sample", estimator: str = "reinforce",
        temperature: float = 1.0, seed: int | None = None, hard: bool = False,
        inference_selection: str = "argmax", **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.selection = _validation.check_choice("selection", selection, SELECTIONS)
        self.estimator = _validation.check_choice("estimator", estimator, ESTIMATORS)
        self.temperature = _check_temperature(temperature)
        self.hard = _validation.check_bool("hard", hard)
        self.inference_selection = _validation.check_choice(
            "inference_selection", inference_selection, SELECTIONS
        )
        self.seed = _validation.check_seed("seed", seed)
        if self.estimator == "reinforce" and not _is_default_temperature(
            self.temperature
        ):
            raise ValueError(
                "`temperature` applies to the 'straight_through' and 'gumbel' "
                "estimators; 'reinforce' samples from the attention "
                "distribution itself. Received: "
                f"temperature={temperature!r} with estimator='reinforce'"
            )
        if self.estimator == "gumbel" and self.selection != "sample":
            raise ValueError(
                "The 'gumbel' estimator samples by construction (Gumbel-max), "
                "so `selection` must be 'sample'. Received: "
                f"selection={selection!r} with estimator='gumbel'"
            )
        self.score = scoring.get(score, dtype=self.dtype_policy)
        samples = "sample" in (self.selection, self.inference_selection)
        self.seed_generator = (
            keras.random.SeedGenerator(self.seed) if samples else None
        )
        self.supports_masking = True

    def build(self, query_shape, value_shape, key_shape=None):
        super().build(query_shape, value_shape, key_shape)
        if isinstance(self.temperature, _Schedule):
            # The step at which the temperature schedule is read; saved with
            # the model so that a resumed training continues the annealing.
            self.iterations = _keras_objects.add_scalar_state(self, "iterations", "int32")
        self.built = True

    @_signatures.takes_arguments_of(
        call_arguments, adding=_log_prob_argument, before="training"
    )
    def call(self, return_attention_scores, return_log_prob, training, **inputs):
        selector = _Selector(self, training=bool(training))
        output, _ = self._attend(**inputs, normalize=selector)
        outputs = (output,)
        if return_attention_scores:
            outputs += (selector.probabilities, selector.selection)
        if return_log_prob:
            outputs += selector.log_prob_and_entropy()
        return outputs[0] if len(outputs) == 1 else outputs

    def current_temperature(self):
        """The temperature in use now: a float32 scalar tensor."""
        temperature = self.temperature
        if isinstance(temperature, _Schedule):
            temperature = temperature(self.iterations)
        return ops.cast(temperature, "float32")

    def compute_output_spec(self, *args, **kwargs):
        arguments = self._call_arguments(args, kwargs)
        query, return_log_prob = arguments["query"], arguments["return_log_prob"]
        output, weights = self._output_spec(
            query, arguments["value"], arguments["key"],
            2 if arguments["return_attention_scores"] else 0,
        )
        outputs = (output, *weights)
        if return_log_prob:
            outputs += (
                keras.KerasTensor((query.shape[0],), dtype="float32"),
                keras.KerasTensor((query.shape[0],), dtype="float32"),
            )
        return outputs[0] if len(outputs) == 1 else outputs

    def get_config(self):
        config = super().get_config()
        temperature = self.temperature
        if not isinstance(temperature, float):
            temperature = keras.saving.serialize_keras_object(temperature)
        config.update(
            {
                "score": scoring.serialize(self.score),
                "selection": self.selection,
                "estimator": self.estimator,
                "temperature": temperature,
                "seed": self.seed,
                "hard": self.hard,
                "inference_selection": self.inference_selection,
            }
        )
        return config


class _Selector:
    """The normalize step of hard attention, for one call of the layer.

    Called by `ops.attention` as `normalize(scores, mask)`, it returns the
    weights of the weighted sum and keeps what else the layer may return:
    `probabilities` and `selection`, `(B, T, S)` in the dtype of the scores;
    `log_prob_and_entropy()` computes the REINFORCE terms on request.
    """

    def __init__(self, layer, training):
        self.layer = layer
        self.training = training

    def __call__(self, scores, mask):
        layer = self.layer
        out_dtype = keras.backend.standardize_dtype(scores.dtype)
        # Selection, log-probabilities and relaxations in float32 for half
        # precision scores, as the softmax of `masked_softmax`.
        work_dtype = attention_ops.softmax_dtype(out_dtype)
        scores = ops.cast(scores, work_dtype)  # (B, T, S)
        everywhere = ops.ones_like(scores, dtype="bool")
        mask = everywhere if mask is None else ops.logical_and(mask, everywhere)
        logits = ops.where(
            mask, scores, attention_ops.mask_fill_value(work_dtype)
        )  # (B, T, S)
        probabilities = attention_ops.masked_softmax(scores, mask)  # (B, T, S)

        rule = layer.selection if self.training else layer.inference_selection
        noise = None
        if rule == "sample":
            # Gumbel-max: argmax(e + g) is a draw from softmax(e). Masked
            # positions keep the (finite) fill value, so they are never drawn.
            noise = _gumbel_noise(
                ops.shape(scores), work_dtype, layer.seed_generator
            )  # (B, T, S)
            index = ops.argmax(logits + noise, axis=-1)  # (B, T)
        else:
            index = ops.argmax(logits, axis=-1)  # (B, T), ties: the first
        positions = ops.arange(ops.shape(scores)[-1], dtype="int32")  # (S,)
        one_hot = ops.equal(positions, ops.cast(index, "int32")[..., None])
        # AND with the mask: a row that may attend to nothing selects nothing.
        selection = ops.cast(ops.logical_and(one_hot, mask), work_dtype)

        self._mask, self._logits = mask, logits
        self._probabilities, self._selection = probabilities, selection
        self.probabilities = ops.cast(probabilities, out_dtype)
        self.selection = ops.cast(selection, out_dtype)

        if not self.training or layer.estimator == "reinforce":
            # REINFORCE's gradient reaches the scorer through `log_prob`.
            return selection
        temperature = ops.cast(layer.current_temperature(), work_dtype)
        if hasattr(layer, "iterations"):
            layer.iterations.assign_add(1)
        if layer.estimator == "straight_through":
            soft = attention_ops.masked_softmax(scores / temperature, mask)
            return _straight_through(selection, soft)
        soft = attention_ops.masked_softmax((scores + noise) / temperature, mask)
        return _straight_through(selection, soft) if layer.hard else soft

    def log_prob_and_entropy(self):
        """`log p(selection)` and `H(pi)`, each summed over queries: `(B,)`.

        From a log-softmax of the masked scores rather than `log(pi)`, which
        is `-inf` where `pi` underflows. Masked positions, and rows with
        nothing to attend to, contribute exactly 0.
        """
        log_probabilities = ops.where(
            self._mask,
            ops.log_softmax(self._logits, axis=-1),
            ops.zeros_like(self._logits),
        )  # (B, T, S)
        log_prob = ops.sum(self._selection * log_probabilities, axis=-1)
        entropy = -ops.sum(self._probabilities * log_probabilities, axis=-1)
        return (
            ops.cast(ops.sum(log_prob, axis=-1), "float32"),  # (B,)
            ops.cast(ops.sum(entropy, axis=-1), "float32"),  # (B,)
        )


def _straight_through(hard, soft):
    """`hard` in the forward pass, the gradient of `soft` in the backward pass.

    `soft - stop_gradient(soft)` is exactly 0, so the forward value is exactly
    `hard` (unlike `stop_gradient(hard - soft) + soft`, which rounds).
    """
    return hard + (soft - ops.stop_gradient(soft))


def _gumbel_noise(shape, dtype, seed):
    """Standard Gumbel noise `-log(-log(u))`, `u ~ U[tiny, 1)`: always finite."""
    tiny = float(np.finfo(dtype).tiny)
    uniform = keras.random.uniform(
        shape, minval=tiny, maxval=1.0, dtype=dtype, seed=seed
    )
    return -ops.log(-ops.log(uniform))


def _check_temperature(temperature):
    """A positive float, or a learning-rate-style schedule (or its config)."""
    if isinstance(temperature, dict):
        temperature = keras.saving.deserialize_keras_object(temperature)
    if isinstance(temperature, _Schedule):
        return temperature
    if not _validation.is_positive_number(temperature):
        raise ValueError(
            "`temperature` must be a positive float or a "
            "`keras.optimizers.schedules.LearningRateSchedule`. Received: "
            f"temperature={temperature!r}"
        )
    return float(temperature)


def _is_default_temperature(temperature):
    return isinstance(temperature, float) and temperature == 1.0
