"""A TensorFlow 2 custom training loop written for Horovod (``horovod.tensorflow``, its MNIST example's
pattern), with only the import line changed: ``DistributedGradientTape`` inside a ``tf.function``, and
``broadcast_variables`` of the model and the optimizer after the first step.

Then, eagerly: ``groups``, worker-local sources, ``get_local_and_global_gradients`` and fp16 compression.
Writes what the test checks to ``OUT/rank<r>.json``.

    tfcs-run -np 2 python tests/multiprocess/horovod_tape_job.py --out OUT
"""

import argparse
import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_commstrategy.horovod as hvd  # noqa: E402  (was: import horovod.tensorflow as hvd)
from tf_commstrategy import process  # noqa: E402  (the test's collective counter)

BATCH, FEATURES, STEPS, LR = 8, 4, 6, 0.1


def collectives() -> int:
    """The host backend's collectives and the compiled all-reduce's (float gradients take it after hvd.init)."""
    from tf_commstrategy.tf.native_path import NativeAllReduce
    group = process.default_group()
    native = NativeAllReduce.ready(group)
    return group.backend("grpc").stats().collectives + (native.calls() if native is not None else 0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()

    hvd.init()
    rng = np.random.default_rng(10 + hvd.rank())  # each worker its own data and initial weights
    x = rng.standard_normal((BATCH * STEPS, FEATURES)).astype(np.float32)
    y = rng.standard_normal((BATCH * STEPS, 1)).astype(np.float32)
    w0 = rng.standard_normal((FEATURES, 1)).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)

    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(FEATURES,),
                                                       kernel_initializer=tf.keras.initializers.Constant(w0))])
    loss = tf.keras.losses.MeanSquaredError()
    opt = tf.keras.optimizers.SGD(LR * hvd.size())

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, model(images, training=True))
        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Horovod: broadcast initial variable states from rank 0 to all other processes, after the first
        # gradient step (which builds the optimizer).
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)
        return loss_value

    counts = []
    for batch, (images, labels) in enumerate(dataset.take(STEPS)):
        before = collectives()
        training_step(images, labels, batch == 0)
        counts.append(collectives() - before)

    # eagerly: groups, local sources, fp16 compression (a two-layer model: 4 variables)
    two = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(FEATURES,)), tf.keras.layers.Dense(1)])
    two.set_weights([np.full(w.shape, 0.1 * (i + 1), np.float32) for i, w in enumerate(two.get_weights())])
    variables = two.trainable_variables
    facts = {}
    with tf.GradientTape(persistent=True) as tape:
        value = loss(y[:BATCH], two(x[:BATCH]))
    own = [g.numpy().tolist() for g in tape.gradient(value, variables)]
    for name, kwargs in (("grouped", dict(groups=2)), ("by_lists", dict(groups=[[variables[0], variables[3]]])),
                         ("fp16", dict(compression=hvd.Compression.fp16))):
        before = collectives()
        grads = hvd.DistributedGradientTape(tape, **kwargs).gradient(value, variables)
        facts[name] = {"collectives": collectives() - before, "grads": [g.numpy().tolist() for g in grads]}
    dtape = hvd.DistributedGradientTape(tape)
    dtape.register_local_source(variables[1])
    before = collectives()
    local, shared = dtape.get_local_and_global_gradients(value, variables)
    facts["local"] = {"collectives": collectives() - before,
                      "local_index": [[v is s for v in variables].index(True) for s, _ in local],
                      "local": [g.numpy().tolist() for _, g in local],
                      "shared": [g.numpy().tolist() for _, g in shared], "class": type(dtape).__name__}

    report = {"w0": w0.tolist(), "x": x.tolist(), "y": y.tolist(), "counts": counts,
              "final": [w.tolist() for w in model.get_weights()], "own": own, "facts": facts}
    with open(os.path.join(a.out, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
