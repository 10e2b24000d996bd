"""A custom training loop: strategy.run + GradientTape, gradients all-reduced, strategy.reduce for the loss.

    tfcs-run -np 2 python examples/custom_training_loop.py [--keras 3|2] [--steps 30]
"""

import argparse
import importlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_commstrategy as tfcs  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--keras", default="3", choices=["3", "2"], help="3: Keras 3 (import keras); 2: tf_keras")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per replica")
    a = p.parse_args()
    keras = importlib.import_module("keras" if a.keras == "3" else "tf_keras")
    strategy = tfcs.CommStrategy()
    global_batch = a.batch_size * strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 16)).astype(np.float32)
    y = (x @ rng.standard_normal((16, 1))).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch)
    dist = iter(strategy.experimental_distribute_dataset(ds))
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
        opt = keras.optimizers.SGD(0.05)

    @tf.function
    def step(batch):
        def replica_step(inputs):
            xb, yb = inputs
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))  # all-reduces the gradients
            return loss
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(batch,)), axis=None)

    first = None
    for i in range(a.steps):
        loss = float(step(next(dist)))
        first = loss if first is None else first
    w = model.get_weights()[0]
    digest = tfcs.allgather(np.array([float(np.sum(w))]))
    assert np.all(digest == digest[0]), "weights differ between workers"
    if tfcs.rank() == 0:
        print(f"custom loop: loss {first:.4f} -> {loss:.4f} after {a.steps} steps; weights identical on "
              f"{tfcs.size()} workers")


if __name__ == "__main__":
    main()
