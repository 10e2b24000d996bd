"""Quickstart: a small Keras model trained on every worker of the job.

    tfcs-run -np 2 python examples/quickstart.py [--keras 3|2]      (3: import keras, the default; 2: tf_keras)
"""
import argparse
import importlib

import numpy as np
import tensorflow as tf
import tf_commstrategy as tfcs

parser = argparse.ArgumentParser()
parser.add_argument("--keras", default="3", choices=["3", "2"])
keras = importlib.import_module("keras" if parser.parse_args().keras == "3" else "tf_keras")

strategy = tfcs.CommStrategy()                     # joins the job that tfcs-run started (rank, size, coordinator)
x = np.random.default_rng(0).random((8192, 8), dtype=np.float32)
y = (x.sum(axis=1) > 4).astype(np.float32)         # a toy task that a small network learns in seconds
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64 * tfcs.size())  # GLOBAL batch; each worker reads its shard
with strategy.scope():                             # variables made here start from rank 0's values everywhere
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"])
model.fit(data, epochs=3, verbose=2 if tfcs.rank() == 0 else 0)  # unchanged Keras; gradients cross workers
print(f"rank {tfcs.rank()} of {tfcs.size()}: accuracy {model.evaluate(data, verbose=0)[1]:.3f}")
