"""Synthetic-data training benchmark in the style of Horovod's: images/s per worker and in total.

    tfcs-run -np 2 python examples/keras_synthetic_benchmark.py [--keras 3|2] [--iters 5] [--batches-per-iter 10]
"""

import argparse
import importlib
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_commstrategy as tfcs  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--keras", default="3", choices=["3", "2"], help="3: Keras 3 (import keras); 2: tf_keras")
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--batches-per-iter", type=int, default=10)
    p.add_argument("--warmup-batches", type=int, default=5)
    a = p.parse_args()
    keras = importlib.import_module("keras" if a.keras == "3" else "tf_keras")
    strategy = tfcs.CommStrategy()
    gb = a.batch_size * tfcs.size()
    rng = np.random.default_rng(tfcs.rank())
    data = tf.data.Dataset.from_tensor_slices((rng.random((gb * 4, 28, 28, 1), dtype=np.float32),
                                               rng.integers(0, 10, gb * 4))).batch(gb).repeat()
    with strategy.scope():
        L = keras.layers
        model = keras.Sequential([keras.Input((28, 28, 1)), L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(),
                                  L.Flatten(), L.Dense(128, activation="relu"), L.Dense(10)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data, epochs=1, steps_per_epoch=a.warmup_batches, verbose=0)
    rates = []
    for i in range(a.iters):
        t0 = time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=a.batches_per_iter, verbose=0)
        rate = a.batch_size * a.batches_per_iter / (time.perf_counter() - t0)
        rates.append(rate)
        if tfcs.rank() == 0:
            print(f"iter #{i}: {rate:.1f} img/sec per worker")
    mean = float(np.mean(rates))
    if tfcs.rank() == 0:
        print(f"img/sec per worker: {mean:.1f} +- {1.96 * float(np.std(rates)):.1f}")
        print(f"total img/sec on {tfcs.size()} workers: {tfcs.size() * mean:.1f}")


if __name__ == "__main__":
    main()
