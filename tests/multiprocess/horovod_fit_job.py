"""A Keras script written for Horovod (``horovod.tensorflow.keras``), with only the import line changed.

It trains a linear model on each worker's shard of the data with ``DistributedOptimizer``, the broadcast,
metric-average and warmup callbacks and two schedule callbacks (as Horovod's ImageNet example does),
twice: with ``tf.keras.optimizers.SGD`` (momentum a Python float) and with the legacy SGD (momentum a
variable). Each worker starts from its own random weights. Writes what the test compares with its numpy
reference to ``OUT/rank<r>.json``.

    tfcs-run -np 2 python tests/multiprocess/horovod_fit_job.py --out OUT
"""

import argparse
import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras, as Horovod needs on TF >= 2.16
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_commstrategy.horovod as hvd  # noqa: E402  (was: import horovod.tensorflow.keras as hvd)

BATCH, SAMPLES, FEATURES = 8, 64, 4
BASE_LR, MOMENTUM, WARMUP, EPOCHS = 0.05, 0.9, 2, 5


def make_data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]]) + 0.7 + 0.1 * rng.standard_normal((SAMPLES, 1)))
    return x, y.astype(np.float32)


def train(legacy: bool, x, y):
    # Horovod: each worker reads its own shard, batched with the per-worker batch size.
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shard(hvd.size(), hvd.rank()).batch(BATCH)
    rng = np.random.default_rng(100 + hvd.rank())  # every worker starts from other weights
    w0 = rng.standard_normal((FEATURES, 1)).astype(np.float32)
    b0 = rng.standard_normal((1,)).astype(np.float32)
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(FEATURES,),
                                                       kernel_initializer=tf.keras.initializers.Constant(w0),
                                                       bias_initializer=tf.keras.initializers.Constant(b0))])

    # Horovod: scale the learning rate by the number of workers, wrap the optimizer.
    scaled_lr = BASE_LR * hvd.size()
    sgd = tf.keras.optimizers.legacy.SGD if legacy else tf.keras.optimizers.SGD
    opt = hvd.DistributedOptimizer(sgd(learning_rate=scaled_lr, momentum=MOMENTUM))
    model.compile(loss="mse", optimizer=opt, experimental_run_tf_function=False)

    raw, lrs = [], []

    class RawLogs(tf.keras.callbacks.Callback):  # each worker's own epoch logs, before the average
        def on_epoch_end(self, epoch, logs=None):
            raw.append(dict(logs))

    class LearningRates(tf.keras.callbacks.Callback):  # the rate each batch runs with
        def on_train_batch_begin(self, batch, logs=None):
            lrs.append(float(tf.keras.backend.get_value(model.optimizer.learning_rate)))

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        RawLogs(),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=WARMUP, verbose=1),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=scaled_lr, multiplier=1.0, start_epoch=WARMUP,
                                                   end_epoch=WARMUP + 1),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=scaled_lr, multiplier=0.5, start_epoch=WARMUP + 1),
        LearningRates(),
    ]
    history = model.fit(dataset, epochs=EPOCHS, callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)
    return {"initial": [w0.tolist(), b0.tolist()], "final": [w.tolist() for w in model.get_weights()],
            "raw_loss": [r["loss"] for r in raw], "loss": history.history["loss"], "lr": history.history["lr"],
            "batch_lrs": lrs, "class": type(model.optimizer).__name__,
            "plain_class": isinstance(model.optimizer, sgd), "iterations": int(model.optimizer.iterations.numpy())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()

    hvd.init()
    x, y = make_data()
    report = {"size": hvd.size(), "x": x.tolist(), "y": y.tolist(),
              "runs": {"sgd": train(False, x, y), "legacy_sgd": train(True, x, y)}}
    with open(os.path.join(a.out, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
