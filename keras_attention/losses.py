"""The REINFORCE objective for hard attention: baseline and entropy bonus.

Shape legend: `B` batch.

Hard attention that samples a position is a stochastic policy: the task loss
does not depend differentiably on the attention distribution, so the scorer
is trained with the score-function (REINFORCE) estimator

    grad E[R] ~ (R - b) * grad log p(selection),

where `R` is a per-example reward (by default minus the task loss), `b` a
baseline that lowers the variance without biasing the estimate, and an
entropy bonus keeps the policy exploring. Minimizing the per-example
surrogate

    -(stop_gradient(R) - b) * log p(selection) - entropy_weight * H

gives that gradient (`reinforce_loss`). `ReinforceModel` adds it to the task
loss under plain `model.fit`, keeping `b` as a moving average of the rewards
in a non-trainable variable that is saved with the model.

The reward needs the targets and the predictions, which a Keras loss sees but
a layer does not, and the baseline is state, which a Keras loss object cannot
keep in a `.keras` file; so the objective lives in the model's
`compute_loss`, the one hook that sees both and runs the same on TensorFlow,
JAX and PyTorch, compiled or not.
"""

import copy
import numbers

import keras
from keras import ops

from keras_attention import _keras_objects
from keras_attention import _validation
from keras_attention._typing import Tensor


def reinforce_loss(
    reward: Tensor,
    log_prob: Tensor,
    entropy: Tensor | None = None,
    baseline: float | Tensor = 0.0,
    entropy_weight: float = 0.0,
) -> Tensor:
    """The per-example REINFORCE surrogate loss.

    `loss_i = -(stop_gradient(R_i) - b) * log p_i - entropy_weight * H_i`.

    Its gradient is the score-function estimate of `-grad E[R]` (with the
    baseline `b`, which must not depend on the example's own selection)
    minus `entropy_weight` times the gradient of the entropy. Its value is
    not a loss to read: only its gradient means something.

    Args:
        reward: `(B,)` rewards; no gradient flows through them.
        log_prob: `(B,)` log-probability of each example's selection, e.g.
            from `HardAttention(...)(..., return_log_prob=True)`.
        entropy: optional `(B,)` entropy of each example's distribution.
        baseline: scalar (or `(B,)`) baseline `b`; no gradient flows
            through it. Defaults to 0.
        entropy_weight: float >= 0, the weight of the entropy bonus.

    Returns:
        `(B,)` float32 surrogate losses.

    Example:

    >>> import numpy as np
    >>> loss = reinforce_loss(
    ...     reward=np.array([1.0, 0.0]),
    ...     log_prob=np.array([-0.5, -2.0]),
    ...     entropy=np.array([0.7, 0.7]),
    ...     baseline=0.5,
    ...     entropy_weight=0.1,
    ... )
    >>> np.round(np.asarray(loss), 4)
    array([ 0.18, -1.07], dtype=float32)

    References:
        - [Williams, 1992](https://doi.org/10.1007/BF00992696)
    """
    entropy_weight = _check_entropy_weight(entropy_weight)
    reward = ops.stop_gradient(ops.cast(reward, "float32"))
    baseline = ops.stop_gradient(ops.cast(baseline, "float32"))
    loss = -(reward - baseline) * ops.cast(log_prob, "float32")
    if entropy is not None and entropy_weight:
        loss = loss - entropy_weight * ops.cast(entropy, "float32")
    return loss


@keras.saving.register_keras_serializable(package="keras_attention")
class ReinforceModel(keras.Model):
    """Trains a model with hard attention by REINFORCE, under `model.fit`.

    Wraps a model `model(inputs) -> (predictions, log_prob, entropy)`, where
    `log_prob` and `entropy` are `(B,)` (for instance from
    `HardAttention(estimator="reinforce")(..., return_log_prob=True)`; add
    those of several layers for a joint policy). The wrapper's own output is
    `predictions`, so `predict`, `evaluate` and metrics see the task only.

    In training, the loss is

        task_loss + mean_i[-(R_i - b) * log_prob_i - entropy_weight * H_i]

    with `task_loss` the loss given to `compile` (and any regularization),
    `R_i` the reward of example `i` (no gradient flows through it) and `b` the
    baseline used for the whole batch. `b` is `baseline`, a moving average of
    the batch-mean reward,
    `baseline <- baseline_decay * baseline + (1 - baseline_decay) * mean(R)`,
    updated after it is used (so that it does not depend on the current
    selections); the first training batch, which has no history, uses and
    stores its own mean reward. `baseline` and `baseline_updates` (the count
    of updates) are non-trainable variables: they are saved in `.keras` files
    and weight files. Evaluation reports the task loss alone. Per-example
    sample weights `(B,)` weigh the REINFORCE term as they weigh the task
    loss (the baseline averages the unweighted rewards).

    Args:
        model: a `keras.Model` (or layer) returning
            `(predictions, log_prob, entropy)`.
        entropy_weight: float >= 0, the weight of the entropy bonus.
            Defaults to 0.01.
        baseline_decay: float in [0, 1), the decay of the moving-average
            baseline; 0 uses the previous batch's mean reward. Defaults to
            0.9.
        reward: optional callable `reward(y_true, y_pred) -> (B,)`; a
            function registered with `keras.saving` so the model can be
            saved. Defaults to minus the per-example value of the loss given
            to `compile` (averaged over any axes after the batch), which must
            then be a single loss. With a `reward`, `compile` may omit the
            loss: the model is then a pure policy (a bandit).
        **kwargs: base `keras.Model` arguments (`name`, ...).

    Call arguments:
        inputs: the inputs of `model`.
        training: bool. In training the call returns a dict with
            `"predictions"`, `"log_prob"` and `"entropy"` for `compute_loss`;
            otherwise the predictions only.

    Example:

    >>> import numpy as np
    >>> import keras
    >>> from keras_attention.layers import HardAttention
    >>> query, memory = keras.Input((1, 8)), keras.Input((6, 8))
    >>> attended, log_prob, entropy = HardAttention(seed=0)(
    ...     query, memory, return_log_prob=True
    ... )
    >>> logits = keras.layers.Dense(3)(keras.layers.Flatten()(attended))
    >>> model = ReinforceModel(
    ...     keras.Model([query, memory], (logits, log_prob, entropy))
    ... )
    >>> model.compile(
    ...     optimizer="adam",
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> x = [np.ones((4, 1, 8), "float32"), np.ones((4, 6, 8), "float32")]
    >>> history = model.fit(x, np.zeros((4,), "int32"), verbose=0)
    >>> tuple(model.predict(x, verbose=0).shape)
    (4, 3)

    References:
        - [Williams, 1992](https://doi.org/10.1007/BF00992696)
        - [Mnih et al., 2014](https://arxiv.org/abs/1406.6247)
        - [Xu et al., 2015](https://arxiv.org/abs/1502.03044)
    """

    def __init__(
        self,
        model,
        entropy_weight=0.01,
        baseline_decay=0.9,
        reward=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(model, keras.layers.Layer):
            raise ValueError(
                "`model` must be a `keras.Model` returning "
                "`(predictions, log_prob, entropy)`. Received: "
                f"model={model!r}"
            )
        outputs = getattr(model, "outputs", None)
        if outputs is not None and len(outputs) != 3:
            raise ValueError(
                "`model` must return `(predictions, log_prob, entropy)`. "
                f"Received: model with {len(outputs)} output(s) {outputs}"
            )
        if reward is not None and not callable(reward):
            raise ValueError(
                "`reward` must be None or a callable "
                f"`reward(y_true, y_pred) -> (batch,)`. Received: reward={reward!r}"
            )
        self.model = model
        self.entropy_weight = _check_entropy_weight(entropy_weight)
        self.baseline_decay = _validation.check_rate("baseline_decay", baseline_decay)
        self.reward = reward
        self.baseline = _keras_objects.add_scalar_state(self, "baseline", "float32")
        self.baseline_updates = _keras_objects.add_scalar_state(self, "baseline_updates", "int32")
        if model.built:
            # Nothing of its own to build: no input shapes to record, so a
            # reloaded model is not rebuilt from them.
            self.built = True

    def call(self, inputs, training=None):
        outputs = self.model(inputs, training=training)
        if not isinstance(outputs, (list, tuple)) or len(outputs) != 3:
            raise ValueError(
                "`model` must return `(predictions, log_prob, entropy)`. "
                f"Received: {outputs!r}"
            )
        predictions, log_prob, entropy = outputs
        if training:
            return {
                "predictions": predictions,
                "log_prob": log_prob,
                "entropy": entropy,
            }
        return predictions

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        if not isinstance(y_pred, dict):
            # Evaluation: the task loss alone.
            if self.loss is None:
                return ops.zeros((), "float32")
            return super().compute_loss(
                x, y, y_pred, sample_weight, training=training
            )
        predictions = y_pred["predictions"]
        if self.loss is None:
            # A pure policy (a bandit): the reward is all there is, plus any
            # regularization.
            loss = ops.zeros((), "float32")
            for extra in self.losses:
                loss = loss + ops.cast(ops.sum(extra), "float32")
        else:
            loss = super().compute_loss(
                x, y, predictions, sample_weight, training=training
            )
        reward = ops.cast(self.compute_reward(y, predictions), "float32")  # (B,)
        batch_reward = ops.mean(reward)
        first = ops.equal(self.baseline_updates.value, 0)
        baseline = ops.where(first, batch_reward, self.baseline.value)
        surrogate = reinforce_loss(
            reward,
            y_pred["log_prob"],
            y_pred["entropy"],
            baseline=baseline,
            entropy_weight=self.entropy_weight,
        )  # (B,)
        if sample_weight is not None:
            surrogate = surrogate * ops.cast(
                ops.reshape(sample_weight, (-1,)), "float32"
            )
        loss = ops.cast(loss, "float32") + ops.mean(surrogate)
        if training:
            decay = self.baseline_decay
            self.baseline.assign(
                decay * baseline + (1.0 - decay) * ops.stop_gradient(batch_reward)
            )
            self.baseline_updates.assign_add(1)
        return loss

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        if isinstance(y_pred, dict):
            y_pred = y_pred["predictions"]
        return super().compute_metrics(x, y, y_pred, sample_weight)

    def compute_reward(self, y_true, y_pred):
        """The per-example reward `(B,)`: `reward`, or minus the task loss."""
        if self.reward is not None:
            return self.reward(y_true, y_pred)
        loss = self.loss
        if loss is None or isinstance(loss, (list, tuple, dict)):
            raise ValueError(
                "`ReinforceModel` with `reward=None` takes minus the task loss "
                "as the reward, so `compile` needs a single `loss`. Received: "
                f"loss={loss!r}"
            )
        loss = keras.losses.get(loss)
        if isinstance(loss, keras.losses.Loss):
            # `call` is the per-example loss, before the reduction `__call__`
            # applies.
            loss_fn, dtype = loss.call, loss.dtype
        else:
            loss_fn, dtype = loss, keras.backend.floatx()
        values = loss_fn(
            ops.convert_to_tensor(y_true, dtype=dtype),
            ops.convert_to_tensor(y_pred, dtype=dtype),
        )
        if len(values.shape) > 1:
            values = ops.mean(values, axis=tuple(range(1, len(values.shape))))
        return -values  # (B,)

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "model": keras.saving.serialize_keras_object(self.model),
            "entropy_weight": self.entropy_weight,
            "baseline_decay": self.baseline_decay,
            # None serializes as None.
            "reward": keras.saving.serialize_keras_object(self.reward),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # Deserializing a functional model empties its config dict in place.
        config = copy.deepcopy(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        if config.get("reward") is not None:
            config["reward"] = keras.saving.deserialize_keras_object(
                config["reward"], custom_objects=custom_objects
            )
        return cls(**config)


def _check_entropy_weight(value):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not value >= 0
        or value == float("inf")
    ):
        raise ValueError(
            "`entropy_weight` must be a non-negative float. Received: "
            f"entropy_weight={value!r}"
        )
    return float(value)


__all__ = ["ReinforceModel", "reinforce_loss"]
