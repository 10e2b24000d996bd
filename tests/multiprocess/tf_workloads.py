"""Small Keras workloads (tf_keras or Keras 3) shared by the strategy tests (imported inside worker processes)."""

import os

import numpy as np

N_SAMPLES = 192
GLOBAL_BATCH = 48   # divisible by 2 and 3 workers x 1 or 2 devices
EPOCHS = 2


def setup_tf(local_devices: int):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    if local_devices > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * local_devices)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    return tf


def data(kind):
    rng = np.random.default_rng(42)
    if kind == "mlp":
        x = rng.standard_normal((N_SAMPLES, 12)).astype(np.float32)
        y = np.argmax(x @ rng.standard_normal((12, 4)), axis=1)
    elif kind == "cnn":
        x = rng.standard_normal((N_SAMPLES, 8, 8, 1)).astype(np.float32)
        y = (x.mean(axis=(1, 2, 3)) > 0).astype(np.int64) + 2 * (x[:, :4].mean(axis=(1, 2, 3)) > 0)
    else:  # embedding
        x = rng.integers(0, 50, (N_SAMPLES, 6))
        y = (x.sum(axis=1) % 4)
    return x, y.astype(np.int64)


def keras_module(flavour: int = 2):
    """The Keras of a flavour: 3 is ``import keras`` (Keras 3), 2 is tf_keras."""
    import importlib
    return importlib.import_module("keras" if flavour == 3 else "tf_keras")


def build(kind, opt, seed, flavour: int = 2):
    keras = keras_module(flavour)
    keras.utils.set_random_seed(seed)
    L = keras.layers
    if kind == "mlp":
        m = keras.Sequential([keras.Input((12,)), L.Dense(16, activation="relu"), L.Dense(4)])
    elif kind == "cnn":
        m = keras.Sequential([keras.Input((8, 8, 1)), L.Conv2D(4, 3, activation="relu"), L.MaxPooling2D(),
                              L.Flatten(), L.Dense(8, activation="relu"), L.Dense(4)])
    else:
        m = keras.Sequential([keras.Input((6,)), L.Embedding(50, 8), L.GlobalAveragePooling1D(), L.Dense(4)])
    o = keras.optimizers.Adam(0.01) if opt == "adam" else keras.optimizers.SGD(0.05, momentum=0.9)
    m.compile(optimizer=o, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m


def train(strategy, kind, opt, seed, flavour: int = 2):
    """fit / evaluate / predict; returns weights, optimizer variables, history, eval and predictions."""
    import tensorflow as tf
    x, y = data(kind)
    with strategy.scope():
        m = build(kind, opt, seed, flavour)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    hist = m.fit(ds, epochs=EPOCHS, verbose=0)
    ev = m.evaluate(ds, verbose=0)
    pred = m.predict(ds, verbose=0)
    return {"weights": [w for w in m.get_weights()],
            "opt": [v.numpy() for v in m.optimizer.variables],
            "history": hist.history, "eval": ev, "pred": pred}


WORKLOADS = [(k, o) for k in ("mlp", "cnn", "embedding") for o in ("adam", "sgd")]
