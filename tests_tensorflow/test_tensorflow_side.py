"""appendix/tensorflow_side.py in the TensorFlow environment: replicas on logical CPUs, gradients equal to the full batch."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow", reason="tests_tensorflow/ runs in the TensorFlow environment (make tensorflow)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "appendix"))
import tensorflow_side as side  # noqa: E402

TOLERANCE = 1e-6  # float32 sums in another order; measured differences are about 1e-8


@pytest.fixture(scope="module")
def strategy():
    import tensorflow as tf
    try:
        names = side.use_cpu_replicas(2)
    except RuntimeError:  # devices already initialised in this process by an earlier test module
        names = [device.name for device in tf.config.list_logical_devices("CPU")]
    assert len(names) >= 2, f"two logical CPUs expected, got {names}"
    return tf.distribute.MirroredStrategy(names[:2])


def test_the_global_batch_is_split_between_replicas(strategy):
    assert strategy.num_replicas_in_sync == 2
    assert side.replica_batch_sizes(strategy, 16) == [8, 8]


def test_mirrored_gradients_equal_the_full_batch_gradients(strategy):
    inputs, labels = side.toy_data()
    with strategy.scope():
        model = side.make_model()
    reference = side.full_batch_gradients(model, inputs, labels)
    mirrored = side.mirrored_gradients(strategy, model, inputs, labels)
    assert [g.shape for g in mirrored] == [g.shape for g in reference]
    assert side.largest_difference(mirrored, reference) <= TOLERANCE


def test_scaling_by_the_replica_batch_gives_twice_the_gradient(strategy):
    inputs, labels = side.toy_data(seed=1)
    with strategy.scope():
        model = side.make_model(seed=1)
    reference = side.full_batch_gradients(model, inputs, labels)
    local = side.mirrored_gradients(strategy, model, inputs, labels, global_scaling=False)
    assert side.largest_difference(local, [2 * g for g in reference]) <= 2 * TOLERANCE
    assert side.largest_difference(local, reference) > 100 * TOLERANCE


def test_one_step_through_apply_gradients_under_the_strategy_equals_the_full_batch_step(strategy):
    import keras
    inputs, labels = side.toy_data(seed=2)
    with strategy.scope():
        mirrored, mirrored_optimizer = side.make_model(seed=2), keras.optimizers.SGD(learning_rate=0.5)
    alone, alone_optimizer = side.make_model(seed=2), keras.optimizers.SGD(learning_rate=0.5)
    before = side.weights(alone)
    assert side.largest_difference(side.weights(mirrored), before) == 0.0
    side.mirrored_train_step(strategy, mirrored, mirrored_optimizer, inputs, labels)
    side.full_batch_train_step(alone, alone_optimizer, inputs, labels)
    assert side.largest_difference(side.weights(alone), before) > 1e-3, "the step should move the weights"
    assert side.largest_difference(side.weights(mirrored), side.weights(alone)) <= TOLERANCE
