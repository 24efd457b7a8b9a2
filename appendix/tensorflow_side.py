"""The capstone's core in TensorFlow: MirroredStrategy replicas, the globally scaled loss, and its summed gradients."""
from __future__ import annotations

import numpy as np


def use_cpu_replicas(count: int = 2) -> list[str]:
    """Split the one physical CPU into `count` logical devices; must run before anything touches the devices.

    Returns the logical device names. Raises RuntimeError (from TensorFlow) once the devices are initialised.
    """
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    return [device.name for device in tf.config.list_logical_devices("CPU")]


def toy_data(samples: int = 16, features: int = 6, classes: int = 3, seed: int = 0):
    """(inputs (samples, features) float32, labels (samples,) int32): a fixed, seeded batch."""
    generator = np.random.default_rng(seed)
    inputs = generator.standard_normal((samples, features)).astype("float32")
    labels = generator.integers(0, classes, samples).astype("int32")
    return inputs, labels


def make_model(features: int = 6, classes: int = 3, seed: int = 0):
    """A two-layer classifier (features -> 16 -> classes logits), the same weights for the same seed."""
    import keras
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(classes)])
    return model


def per_example_loss(model, inputs, labels):
    """Cross-entropy of each sample: (batch,) from logits (batch, classes) and labels (batch,)."""
    import tensorflow as tf
    return tf.keras.losses.sparse_categorical_crossentropy(labels, model(inputs, training=True), from_logits=True)


def full_batch_gradients(model, inputs, labels) -> list[np.ndarray]:
    """One replica, the whole batch: gradients of the mean loss, the reference."""
    import tensorflow as tf
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(per_example_loss(model, inputs, labels))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def _one_global_batch(strategy, inputs, labels):
    """Each replica's share of one global batch, as experimental_distribute_dataset splits it."""
    import tensorflow as tf
    dataset = tf.data.Dataset.from_tensor_slices((inputs, labels)).batch(len(labels))
    return next(iter(strategy.experimental_distribute_dataset(dataset)))


def _replica_gradients(model, inputs, labels, global_batch: int, global_scaling: bool = True):
    """One replica's gradients: its loss sum scaled by the GLOBAL batch (or, the mistake, its own mean)."""
    import tensorflow as tf
    with tf.GradientTape() as tape:
        losses = per_example_loss(model, inputs, labels)
        loss = (tf.nn.compute_average_loss(losses, global_batch_size=global_batch) if global_scaling
                else tf.reduce_mean(losses))
    return tape.gradient(loss, model.trainable_variables)


def mirrored_gradients(strategy, model, inputs, labels, global_scaling: bool = True) -> list[np.ndarray]:
    """Gradients under strategy: each replica gets global_batch / replicas samples from the distributed dataset,
    scales its loss sum by the GLOBAL batch (compute_average_loss), and the replicas' gradients are summed.

    global_scaling=False divides by the replica's own batch instead: the usual mistake, gradients n times too big.
    The model must have been built inside strategy.scope().
    """
    import tensorflow as tf

    def replica_step(replica_inputs, replica_labels):
        return _replica_gradients(model, replica_inputs, replica_labels, len(labels), global_scaling)

    per_replica = strategy.run(replica_step, args=_one_global_batch(strategy, inputs, labels))
    return [strategy.reduce(tf.distribute.ReduceOp.SUM, g, axis=None).numpy() for g in per_replica]


def replica_batch_sizes(strategy, global_batch: int, features: int = 6) -> list[int]:
    """How experimental_distribute_dataset splits one global batch: the samples each replica receives."""
    import tensorflow as tf
    dataset = tf.data.Dataset.from_tensor_slices(np.zeros((global_batch, features), "float32")).batch(global_batch)
    shard = next(iter(strategy.experimental_distribute_dataset(dataset)))
    return [int(t.shape[0]) for t in strategy.experimental_local_results(shard)]


def largest_difference(first: list[np.ndarray], second: list[np.ndarray]) -> float:
    """Largest absolute element-wise difference over matching gradient lists."""
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second))


def mirrored_train_step(strategy, model, optimizer, inputs, labels) -> None:
    """One training step under strategy: each replica takes its share of the global batch, scales its loss sum by
    the global batch and calls optimizer.apply_gradients inside strategy.run, which all-reduces (sums) the
    replicas' gradients before every replica applies the same update. Model and optimizer built in strategy.scope()."""
    import tensorflow as tf

    def replica_step(replica_inputs, replica_labels):
        gradients = _replica_gradients(model, replica_inputs, replica_labels, len(labels))
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))

    strategy.run(tf.function(replica_step), args=_one_global_batch(strategy, inputs, labels))


def full_batch_train_step(model, optimizer, inputs, labels) -> None:
    """The reference: one replica, one optimizer step on the mean loss of the whole batch."""
    import tensorflow as tf
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(per_example_loss(model, inputs, labels))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


def weights(model) -> list[np.ndarray]:
    """The model's trainable weights as arrays (a mirrored variable reads as its value, the same on every replica)."""
    return [variable.numpy() for variable in model.trainable_variables]
