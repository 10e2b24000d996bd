"""A/B of the per-step communication in ONE job: gradients concatenated and split in the graph (the
default) vs handed over as they are (``allreduce_many``); metric state riding on the gradient
all-reduce (the default) vs its own collective (a model with its own ``compute_metrics`` keeps
tf_keras's step order: 2 collectives); the collective called through ``tf.numpy_function`` (the
default) vs ``tf.py_function``.

    tfcs-run -np 2 python benchmarks/fusion_ab.py [--rounds 5] [--steps 100] [--variants concat-split,py_function]

Copies of the reference CNN are built in the same workers, each traced with one variant; their
fit() calls alternate, so both see the same machine state (this 2-core VM's speed drifts by 20-50%
between runs, far more than the difference measured). Prints each variant's median step time per round.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=64, help="samples per worker per step")
    p.add_argument("--variants", default="concat-split,in-place,metrics-apart,py_function",
                   help="comma-separated, from: concat-split (the default path), in-place (allreduce_many), "
                        "metrics-apart (concat-split, metrics in their own collective), py_function")
    a = p.parse_args()
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras
    import tf_commstrategy as tfcs
    from tf_commstrategy.tf import cross_device_ops, tensor_ops
    strategy = tfcs.CommStrategy()
    n, rank = tfcs.size(), tfcs.rank()
    rng = np.random.default_rng(rank)
    x = rng.random((a.batch * n * 8, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, a.batch * n * 8)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(a.batch * n).repeat()  # a.batch per worker
    models = {}
    class OwnMetrics(keras.Sequential):  # tf_keras's order: the metrics get their own collective
        def compute_metrics(self, x, y, y_pred, sample_weight):
            return super().compute_metrics(x, y, y_pred, sample_weight)

    order = [v.strip() for v in a.variants.split(",")]
    if os.environ.get("AB_REVERSE") == "1":
        order.reverse()
    for variant in order:
        cross_device_ops._HOST_IN_PLACE = variant == "in-place"
        tensor_ops._NUMPY_FUNCTION = variant != "py_function"
        with strategy.scope():
            L = keras.layers
            m = (OwnMetrics if variant == "metrics-apart" else keras.Sequential)([L.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)), L.MaxPooling2D(),
                                  L.Flatten(), L.Dense(128, activation="relu"), L.Dense(10)])
            m.compile(optimizer="adam", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        m.fit(ds, epochs=1, steps_per_epoch=20, verbose=0)  # traces with this variant
        models[variant] = m
    times = {v: [] for v in models}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.marks.append(time.perf_counter())

    for r in range(a.rounds):
        for v, m in models.items():
            c = Clock()
            c.marks = []
            m.fit(ds, epochs=1, steps_per_epoch=a.steps + 10, verbose=0, callbacks=[c])
            steps = [b - a_ for a_, b in zip(c.marks[10:], c.marks[11:])]
            times[v].append(1e3 * statistics.median(steps))
        if rank == 0:
            print(f"round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.2f} ms" for v in times), flush=True)
    if rank == 0:
        for a_name, b_name in (("concat-split", "in-place"), ("metrics-apart", "concat-split"),
                               ("concat-split", "py_function")):
            if a_name not in times or b_name not in times:
                continue
            print(f"{b_name} / {a_name} per round: " + ", ".join(
                f"{b / a_:.3f}" for a_, b in zip(times[a_name], times[b_name])))


if __name__ == "__main__":
    main()
