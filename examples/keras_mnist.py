"""Train a small CNN on MNIST with CommStrategy: the main demo (`make demo`).

    tfcs-run -np 2 python examples/keras_mnist.py [--keras 3|2] [--backend grpc|nccl|auto] [--epochs 2]
                                                  [--batch-size 64]

``--keras 3`` (the default) trains with Keras 3, what ``import keras`` and TensorFlow's ``tf.keras`` give;
``--keras 2`` with tf_keras (Keras 2).

Uses the real MNIST when it is already in the Keras cache (~/.keras/datasets/mnist.npz), otherwise
synthetic MNIST-shaped data with learnable structure (nothing is downloaded).
"""

import argparse
import importlib
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_commstrategy as tfcs  # noqa: E402


def load_data(n_train=12000, n_test=2000):
    path = os.path.expanduser("~/.keras/datasets/mnist.npz")
    if os.path.exists(path):
        with np.load(path) as f:
            xtr, ytr, xte, yte = f["x_train"][:n_train], f["y_train"][:n_train], f["x_test"][:n_test], f["y_test"][:n_test]
        source = "real MNIST from the Keras cache"
    else:
        # Synthetic digits: each class is a fixed random 28x28 template plus noise, so the task is learnable.
        rng = np.random.default_rng(0)
        templates = rng.random((10, 28, 28)) > 0.7
        def make(n):
            y = rng.integers(0, 10, n)
            x = templates[y] * 90 + rng.normal(0, 110, (n, 28, 28))
            return np.clip(x, 0, 255).astype(np.uint8), y
        (xtr, ytr), (xte, yte) = make(n_train), make(n_test)
        source = "synthetic MNIST-shaped data (MNIST not in the Keras cache; nothing downloaded)"
    prep = lambda x: (x[..., None] / 255.0).astype(np.float32)  # noqa: E731
    return (prep(xtr), ytr.astype(np.int64)), (prep(xte), yte.astype(np.int64)), source


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--keras", default="3", choices=["3", "2"], help="3: Keras 3 (import keras); 2: tf_keras")
    p.add_argument("--backend", default=None, choices=["grpc", "nccl", "auto"])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--train-samples", type=int, default=12000)
    a = p.parse_args()
    keras = importlib.import_module("keras" if a.keras == "3" else "tf_keras")

    strategy = tfcs.CommStrategy(backend=a.backend)
    (xtr, ytr), (xte, yte), source = load_data(a.train_samples)
    if tfcs.rank() == 0:
        print(f"data: {source}; {tfcs.size()} workers, {strategy.num_replicas_in_sync} replicas, "
              f"Keras {keras.__version__}")
    global_batch = a.batch_size * tfcs.size()
    train = tf.data.Dataset.from_tensor_slices((xtr, ytr)).shuffle(10000, seed=0).batch(global_batch)
    test = tf.data.Dataset.from_tensor_slices((xte, yte)).batch(global_batch)

    with strategy.scope():
        L = keras.layers
        model = keras.Sequential([keras.Input((28, 28, 1)), L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(),
                                  L.Flatten(), L.Dense(128, activation="relu"), L.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(0.001 * tfcs.size()),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    callbacks = [tfcs.callbacks.LearningRateWarmupCallback(0.001 * tfcs.size(), warmup_epochs=1),
                 tfcs.callbacks.MetricAverageCallback()]
    t0 = time.perf_counter()
    model.fit(train, epochs=a.epochs, validation_data=test, callbacks=callbacks)  # progress bar on rank 0 only
    elapsed = time.perf_counter() - t0
    loss, acc = model.evaluate(test, verbose=0)
    backend = strategy.extended._backend_name or tfcs.process.default_group().default_backend
    if tfcs.rank() == 0:
        print(f"final: test accuracy {acc:.4f}, loss {loss:.4f}, "
              f"{a.epochs * len(xtr) / elapsed:,.0f} samples/s on {tfcs.size()} workers, backend {backend}")


if __name__ == "__main__":
    main()
