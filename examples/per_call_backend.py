"""Per-call backend choice: gradients through one backend, metrics through another.

    tfcs-run -np 2 python examples/per_call_backend.py [--grad-backend grpc] [--metric-backend grpc]

Gradients are all-reduced with ``CommunicationOptions(implementation=...)`` passed to
``ReplicaContext.all_reduce``; the loss metric is reduced with ``tfcs.CommOptions(backend=...)``
passed to ``strategy.extended.reduce_to`` (``strategy.reduce`` takes no options). On a GPU machine use --grad-backend nccl to move gradients through NCCL
while the scalar metrics stay on grpc.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_commstrategy as tfcs  # noqa: E402

IMPL = {"grpc": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grad-backend", default="grpc", choices=sorted(IMPL))
    p.add_argument("--metric-backend", default="grpc", choices=["grpc", "nccl", "auto"])
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    strategy = tfcs.CommStrategy()
    grad_opts = tf.distribute.experimental.CommunicationOptions(implementation=IMPL[a.grad_backend])
    metric_opts = tfcs.CommOptions(backend=a.metric_backend)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 8)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    gb = 32 * strategy.num_replicas_in_sync
    it = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb)))
    with strategy.scope():
        w = tf.Variable(tf.zeros([8, 1]))

    @tf.function
    def step(batch):
        def fn(inputs):
            xb, yb = inputs
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(xb @ w - yb)) / gb
            g = tape.gradient(loss, w)
            g = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, g, options=grad_opts)
            w.assign_sub(0.1 * g)
            return loss
        per_replica_loss = strategy.run(fn, args=(batch,))
        return strategy.extended.reduce_to(tf.distribute.ReduceOp.SUM, per_replica_loss, destinations="/cpu:0",
                                           options=metric_opts)

    losses = [float(step(next(it))) for _ in range(a.steps)]
    if tfcs.rank() == 0:
        print(f"gradients via {a.grad_backend}, metrics via {a.metric_backend}: loss {losses[0]:.3f} -> "
              f"{losses[-1]:.4f}")


if __name__ == "__main__":
    main()
