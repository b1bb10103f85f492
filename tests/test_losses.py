"""Tests of the REINFORCE objective: `reinforce_loss` and `ReinforceModel`."""

import json

import keras
import numpy as np
import pytest

import harness
from keras_attention import losses
from keras_attention.layers import HardAttention

BACKEND = keras.backend.backend()
ARMS = 5
ARM_REWARDS = np.array([0.0, 0.2, 1.0, 0.4, 0.1], "float32")


@keras.saving.register_keras_serializable(package="keras_attention_tests")
def arm_reward(y_true, y_pred):
    """The reward of the pulled arm: `y_pred` is one-hot, `y_true` the rewards."""
    return keras.ops.sum(y_true * y_pred, axis=-1)


def _bandit_policy(seed=0):
    """`(predictions, log_prob, entropy)`: a learned query picks one of 5 arms.

    The predictions are the one-hot arm pulled, `(B, ARMS)`.
    """
    token = keras.Input((1,), dtype="int32", name="token")  # always 0
    arms = keras.Input((ARMS,), dtype="int32", name="arms")  # 0 .. ARMS - 1
    query = keras.layers.Embedding(1, 4, name="query")(token)  # (B, 1, 4)
    keys = keras.layers.Embedding(ARMS, 4, name="arm_keys")(arms)  # (B, ARMS, 4)
    values = keras.layers.Embedding(
        ARMS, ARMS, embeddings_initializer="identity", trainable=False,
        name="one_hot",
    )(arms)  # (B, ARMS, ARMS)
    pulled, log_prob, entropy = HardAttention(score="dot", seed=seed, name="hard")(
        query, values, key=keys, return_log_prob=True
    )
    pulled = keras.layers.Reshape((ARMS,))(pulled)
    policy = keras.Model({"token": token, "arms": arms}, (pulled, log_prob, entropy))
    # The same start on every backend, neither near 0 (where both embeddings'
    # gradients vanish) nor sure of one arm: E[R] = 0.21 at pi =
    # [0.43, 0.14, 0.06, 0.27, 0.11].
    rng = np.random.default_rng(0)
    policy.get_layer("query").set_weights([rng.normal(size=(1, 4))])
    policy.get_layer("arm_keys").set_weights([rng.normal(size=(ARMS, 4))])
    return policy


def _bandit_data(batch):
    x = {
        "token": np.zeros((batch, 1), "int32"),
        "arms": np.tile(np.arange(ARMS, dtype="int32"), (batch, 1)),
    }
    return x, np.tile(ARM_REWARDS, (batch, 1))


def _arm_probabilities(model):
    """The policy's distribution over arms, from its weights, in numpy."""
    policy = model.model
    query = harness.to_numpy(policy.get_layer("query").embeddings)[0]  # (4,)
    keys = harness.to_numpy(policy.get_layer("arm_keys").embeddings)  # (ARMS, 4)
    scores = keys.astype("float64") @ query
    pi = np.exp(scores - scores.max())
    return pi / pi.sum()


def _classifier(num_classes=3, seed=0):
    """`(logits, log_prob, entropy)`: 3 queries, each reading 1 of 5 rows."""
    query = keras.Input((3, 6), name="query")
    memory = keras.Input((5, 6), name="memory")
    attended, log_prob, entropy = HardAttention(score="dot", seed=seed, name="hard")(
        query, memory, return_log_prob=True
    )
    logits = keras.layers.Dense(num_classes, name="head")(
        keras.layers.Flatten()(attended)
    )
    return keras.Model([query, memory], (logits, log_prob, entropy))


def _classifier_data(batch=4, seed=0):
    rng = np.random.default_rng(seed)
    x = [
        rng.normal(size=(batch, 3, 6)).astype("float32"),
        rng.normal(size=(batch, 5, 6)).astype("float32"),
    ]
    return x, rng.integers(0, 3, size=(batch,)).astype("int32")


def _json(config):
    return json.loads(json.dumps(config))


def _cross_entropy(logits, labels):
    logits = logits.astype("float64")
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -log_softmax[np.arange(len(labels)), labels]


# reinforce_loss.


def test_reinforce_loss_by_hand():
    loss = losses.reinforce_loss(
        reward=np.array([1.0, 0.0, 2.0]),
        log_prob=np.array([-0.5, -2.0, -1.0]),
        entropy=np.array([0.7, 0.7, 0.0]),
        baseline=0.5,
        entropy_weight=0.1,
    )
    # -(R - b) log p - 0.1 H
    np.testing.assert_allclose(
        harness.to_numpy(loss), [0.25 - 0.07, -1.0 - 0.07, 1.5], rtol=1e-6
    )
    assert keras.backend.standardize_dtype(loss.dtype) == "float32"
    # No entropy, a per-example baseline.
    loss = losses.reinforce_loss(
        np.array([1.0, 3.0]), np.array([-1.0, -1.0]), baseline=np.array([2.0, 1.0])
    )
    np.testing.assert_allclose(harness.to_numpy(loss), [-1.0, 2.0], rtol=1e-6)


def test_reinforce_loss_gradient_flows_only_through_log_prob_and_entropy():
    reward = keras.Variable(np.array([1.0, -1.0], "float32"))
    baseline = keras.Variable(np.array(0.25, "float32"))
    log_prob = keras.Variable(np.array([-0.5, -1.5], "float32"))
    entropy = keras.Variable(np.array([0.3, 0.6], "float32"))
    variables = [reward, baseline, log_prob, entropy]
    grads = harness.variable_gradients(
        lambda: keras.ops.sum(
            losses.reinforce_loss(
                reward.value, log_prob.value, entropy.value, baseline.value, 0.2
            )
        ),
        variables,
        jit=True,
    )
    np.testing.assert_array_equal(grads[0], [0.0, 0.0])
    assert grads[1] == 0.0
    np.testing.assert_allclose(grads[2], [-0.75, 1.25], rtol=1e-6)
    np.testing.assert_allclose(grads[3], [-0.2, -0.2], rtol=1e-6)


def test_reinforce_gradient_matches_the_analytic_gradient_of_expected_reward():
    # A bandit of 6 arms, pi = softmax(K q). Each of 2000 examples pulls 4
    # arms (4 queries, all q) and gets R = sum_t r(z_t), so E[R] = 4 pi . r and
    # d E[R] / d q = 4 sum_s pi_s (r_s - pi . r) k_s: the analytic gradient
    # against the REINFORCE estimate from the layer's 8,000 draws.
    examples, pulls, arms, baseline, entropy_weight = 2000, 4, 6, 0.3, 0.05
    rewards = np.array([0.0, 0.2, 1.0, 0.4, 0.1, -0.3], "float32")
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(arms, 6)).astype("float32")
    query = keras.Variable(0.4 * rng.normal(size=(1, 1, 6)).astype("float32"))
    key_batch = np.repeat(keys[None], examples, axis=0)  # (B, S, 6)
    values = np.repeat(np.eye(arms, dtype="float32")[None], examples, axis=0)

    def surrogate(layer, reward_weight, entropy_weight):
        def loss():
            queries = keras.ops.tile(query.value, (examples, pulls, 1))  # (B, T, 6)
            pulled, log_prob, entropy = layer(
                queries, values, key=key_batch, training=True, return_log_prob=True
            )  # (B, T, S), (B,), (B,)
            reward = keras.ops.sum(keras.ops.multiply(pulled, rewards), (1, 2))
            # reward_weight=0 leaves R - b = 0: the entropy bonus alone.
            reward = reward_weight * reward + (1 - reward_weight) * baseline
            return keras.ops.mean(
                losses.reinforce_loss(
                    reward, log_prob, entropy, baseline, entropy_weight
                )
            )

        return loss

    (estimate,) = harness.variable_gradients(
        surrogate(HardAttention(score="dot", seed=7), 1.0, 0.0), [query], jit=True
    )
    estimate = -estimate[0, 0]  # the surrogate's gradient is minus grad E[R]

    scores = keys.astype("float64") @ harness.to_numpy(query)[0, 0]
    pi = np.exp(scores - scores.max())
    pi /= pi.sum()
    analytic = pulls * (pi * (rewards - pi @ rewards)) @ keys

    # The same seed draws the same arms: the estimate computed in numpy.
    twin = HardAttention(score="dot", seed=7)
    pulled = harness.to_numpy(twin(
        np.tile(harness.to_numpy(query), (examples, pulls, 1)), values,
        key=key_batch, training=True,
    ))  # (B, T, S)
    np.testing.assert_allclose(pulled.mean((0, 1)), pi, atol=0.02)
    reward = (pulled @ rewards).sum(1)  # (B,)
    # (R - b) * d log p / d q = (R - b) * sum_t (k_{z_t} - sum_s pi_s k_s)
    per_example = (reward - baseline)[:, None] * (pulled @ keys - pi @ keys).sum(1)
    np.testing.assert_allclose(estimate, per_example.mean(0), rtol=1e-4, atol=1e-5)
    # ... and the estimate is the analytic gradient up to sampling noise.
    standard_error = per_example.std(0) / np.sqrt(examples)
    assert np.all(np.abs(estimate - analytic) < 4 * standard_error), (
        estimate, analytic, standard_error
    )
    assert np.linalg.norm(analytic) > 5 * np.linalg.norm(standard_error)

    # The entropy bonus: exactly -entropy_weight * dH/dq per query, with
    # dH/dq = -sum_s pi_s (log pi_s + H) k_s.
    (bonus,) = harness.variable_gradients(
        surrogate(HardAttention(score="dot", seed=7), 0.0, entropy_weight),
        [query],
        jit=True,
    )
    entropy = -np.sum(pi * np.log(pi))
    entropy_gradient = -(pi * (np.log(pi) + entropy)) @ keys
    np.testing.assert_allclose(
        bonus[0, 0], -entropy_weight * pulls * entropy_gradient, rtol=1e-3, atol=1e-6
    )


# ReinforceModel.


def test_compute_loss_and_baseline_by_hand():
    entropy_weight, decay = 0.1, 0.8
    model = losses.ReinforceModel(
        _classifier(), entropy_weight=entropy_weight, baseline_decay=decay
    )
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    baseline = None
    for step in range(3):
        x, labels = _classifier_data(seed=step)
        y_pred = model(x, training=True)
        assert sorted(y_pred) == ["entropy", "log_prob", "predictions"]
        loss = harness.to_numpy(model.compute_loss(x, labels, y_pred, training=True))
        logits, log_prob, entropy = (
            harness.to_numpy(y_pred[name])
            for name in ("predictions", "log_prob", "entropy")
        )
        cross_entropy = _cross_entropy(logits, labels)
        reward = -cross_entropy
        # The first batch is its own baseline; later ones use the average.
        used = reward.mean() if baseline is None else baseline
        surrogate = -(reward - used) * log_prob - entropy_weight * entropy
        np.testing.assert_allclose(
            loss, cross_entropy.mean() + surrogate.mean(), rtol=1e-5, atol=1e-6
        )
        baseline = reward.mean() if baseline is None else (
            decay * baseline + (1 - decay) * reward.mean()
        )
        np.testing.assert_allclose(
            harness.to_numpy(model.baseline), baseline, rtol=1e-5
        )
        assert int(harness.to_numpy(model.baseline_updates)) == step + 1
    # Per-example sample weights weigh both terms (Keras' sum over the batch
    # size for the task loss).
    weights = np.array([0.5, 2.0, 0.0, 1.0], "float32")
    y_pred = model(x, training=True)
    loss = harness.to_numpy(
        model.compute_loss(x, labels, y_pred, sample_weight=weights, training=True)
    )
    logits, log_prob, entropy = (
        harness.to_numpy(y_pred[name])
        for name in ("predictions", "log_prob", "entropy")
    )
    cross_entropy = _cross_entropy(logits, labels)
    surrogate = -(-cross_entropy - baseline) * log_prob - entropy_weight * entropy
    np.testing.assert_allclose(
        loss, np.mean(weights * cross_entropy) + np.mean(weights * surrogate),
        rtol=1e-5, atol=1e-6,
    )
    baseline = decay * baseline + (1 - decay) * (-cross_entropy).mean()
    # Evaluation: the task loss alone, and the baseline stays.
    logits = model(x)
    np.testing.assert_array_equal(
        harness.to_numpy(logits), harness.to_numpy(model.model(x)[0])
    )
    loss = model.compute_loss(x, labels, logits, training=False)
    np.testing.assert_allclose(
        harness.to_numpy(loss), _cross_entropy(harness.to_numpy(logits), labels).mean(),
        rtol=1e-5,
    )
    np.testing.assert_allclose(harness.to_numpy(model.baseline), baseline, rtol=1e-5)


@pytest.mark.parametrize(
    "loss, y_true, y_pred, expected",
    [
        (
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            np.array([0, 2]),
            np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 1.0]], "float32"),
            -_cross_entropy(
                np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 1.0]]), np.array([0, 2])
            ),
        ),
        # A loss function by name, over a sequence: averaged over the rest.
        (
            "mse",
            np.zeros((2, 3, 2), "float32"),
            np.array([[[1, 1], [0, 0], [2, 0]], [[0, 0], [0, 0], [0, 3]]], "float32"),
            -np.array([(1 + 0 + 2) / 3, (0 + 0 + 4.5) / 3]),
        ),
    ],
    ids=["sparse_categorical_crossentropy", "mse"],
)
def test_default_reward_is_minus_the_per_example_task_loss(
    loss, y_true, y_pred, expected
):
    model = losses.ReinforceModel(_classifier())
    model.compile(optimizer="sgd", loss=loss)
    reward = harness.to_numpy(model.compute_reward(y_true, y_pred))
    np.testing.assert_allclose(reward, expected, rtol=1e-5)


def test_fit_raises_the_expected_reward_of_a_bandit_under_jit():
    model = losses.ReinforceModel(
        _bandit_policy(seed=1), entropy_weight=0.01, reward=arm_reward
    )
    # No task loss: a bandit is all reward. Compiled: XLA on TensorFlow,
    # jax.jit on JAX; on PyTorch `jit_compile=True` means torch.compile, which
    # takes minutes on a CPU, so there the eager path users run is tested.
    model.compile(
        optimizer=keras.optimizers.SGD(1.0), jit_compile=BACKEND != "torch"
    )
    x, y = _bandit_data(64)
    before = _arm_probabilities(model) @ ARM_REWARDS
    history = model.fit(x, y, batch_size=64, epochs=25, verbose=0)
    after = _arm_probabilities(model) @ ARM_REWARDS
    assert before < 0.5 and after > 0.9, (before, after)
    assert np.all(np.isfinite(history.history["loss"]))
    # The baseline tracks the rewards the policy collected.
    baseline = float(harness.to_numpy(model.baseline))
    assert before < baseline <= 1.0
    assert int(harness.to_numpy(model.baseline_updates)) == 25
    # At inference the policy pulls its best arm.
    np.testing.assert_array_equal(model.predict(x, verbose=0)[:, 2], 1.0)


def test_baseline_round_trips_through_a_keras_file(tmp_path):
    # Another optimizer, Keras' default compilation, and a save in between.
    model = losses.ReinforceModel(
        _bandit_policy(seed=2), entropy_weight=0.02, baseline_decay=0.5,
        reward=arm_reward, name="bandit",
    )
    model.compile(optimizer=keras.optimizers.Adam(0.1))
    x, y = _bandit_data(64)
    before = _arm_probabilities(model) @ ARM_REWARDS
    model.fit(x, y, batch_size=64, epochs=12, verbose=0)
    baseline = harness.to_numpy(model.baseline)
    assert baseline > before
    path = str(tmp_path / "bandit.keras")
    model.save(path)
    restored = keras.saving.load_model(path)  # safe_mode=True by default
    assert isinstance(restored, losses.ReinforceModel)
    assert harness.to_numpy(restored.baseline) == baseline
    assert int(harness.to_numpy(restored.baseline_updates)) == 12
    for saved in (model, restored):
        paths = [w.path for w in saved.non_trainable_weights]
        assert "bandit/baseline" in paths and "bandit/baseline_updates" in paths
    # Equal up to JSON's tuples -> lists.
    assert _json(restored.get_config()) == _json(model.get_config())
    np.testing.assert_array_equal(
        restored.predict(x, verbose=0), model.predict(x, verbose=0)
    )
    # Training resumes from the saved baseline and optimizer state, and
    # reaches the best arm.
    restored.fit(x, y, batch_size=64, epochs=13, verbose=0)
    assert int(harness.to_numpy(restored.baseline_updates)) == 25
    assert int(harness.to_numpy(restored.optimizer.iterations)) == 25
    assert _arm_probabilities(restored) @ ARM_REWARDS > 0.9


def test_config_round_trip():
    model = losses.ReinforceModel(
        _classifier(), entropy_weight=0.5, baseline_decay=0.0, reward=arm_reward,
        name="policy",
    )
    config = model.get_config()
    assert config["entropy_weight"] == 0.5 and config["baseline_decay"] == 0.0
    clone = losses.ReinforceModel.from_config(config)
    assert clone.get_config() == config
    assert clone.reward is arm_reward
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(model)
    )
    assert restored.get_config() == config
    # Every argument is stored under its own name.
    for name in ("entropy_weight", "baseline_decay"):
        assert getattr(clone, name) == config[name]


# Error messages.


@pytest.mark.parametrize("value", [-0.1, float("inf"), "0.1", True, None])
def test_rejects_bad_entropy_weight(value):
    with pytest.raises(
        ValueError, match=r"`entropy_weight` must be a non-negative float.*"
        r"Received: entropy_weight="
    ):
        losses.ReinforceModel(_classifier(), entropy_weight=value)
    with pytest.raises(ValueError, match=r"`entropy_weight` must be"):
        losses.reinforce_loss([1.0], [-1.0], entropy_weight=value)


@pytest.mark.parametrize("value", [-0.1, 1.0, "0.9", True])
def test_rejects_bad_baseline_decay(value):
    with pytest.raises(
        ValueError, match=r"`baseline_decay` must be a float in \[0, 1\).*"
        r"Received: baseline_decay="
    ):
        losses.ReinforceModel(_classifier(), baseline_decay=value)


def test_rejects_bad_model_and_reward():
    with pytest.raises(ValueError, match=r"`model` must be a `keras.Model`.*model='a'"):
        losses.ReinforceModel("a")
    inputs = keras.Input((3,))
    two_outputs = keras.Model(inputs, (inputs, keras.ops.sum(inputs, axis=-1)))
    with pytest.raises(
        ValueError, match=r"\(predictions, log_prob, entropy\).*2 output"
    ):
        losses.ReinforceModel(two_outputs)
    with pytest.raises(
        ValueError, match=r"`reward` must be None or a callable.*reward=3"
    ):
        losses.ReinforceModel(_classifier(), reward=3)


def test_default_reward_needs_a_single_compiled_loss():
    x, labels = _classifier_data()
    model = losses.ReinforceModel(_classifier())
    model.compile(optimizer="sgd")
    with pytest.raises(ValueError, match=r"needs a single `loss`.*loss=None"):
        model.fit(x, labels, epochs=1, verbose=0)
