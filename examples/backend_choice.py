"""Where a collective's backend is chosen: the strategy's default, one call's options, the direct API.

    tfcs-run -np 2 python examples/backend_choice.py
"""
import logging

import numpy as np
import tensorflow as tf

import tf_commstrategy as tfcs

logging.basicConfig(format="%(message)s")
logging.getLogger("tf_commstrategy").setLevel(logging.INFO)  # INFO: says which backend "auto" chose

RING = tf.distribute.experimental.CommunicationImplementation.RING
strategy = tfcs.CommStrategy(  # the strategy's default for calls that bring no options: RING -> grpc
    communication_options=tf.distribute.experimental.CommunicationOptions(implementation=RING))


def replica_fn(x):
    ctx = tf.distribute.get_replica_context()
    total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, x)  # no options: the strategy's default
    mean = ctx.all_reduce(tf.distribute.ReduceOp.MEAN, x,  # this call only: grpc, a 30 s deadline
                          options=tfcs.CommOptions(backend="grpc", timeout_seconds=30))
    return total, mean


total, mean = tf.function(lambda x: strategy.run(replica_fn, args=(x,)))(tf.fill([3], tfcs.rank() + 1.0))
biggest = tfcs.allreduce(np.full(3, tfcs.rank() + 1.0), op="max", backend="auto")  # numpy: auto -> grpc
print(f"rank {tfcs.rank()}: sum={total.numpy().tolist()} mean={mean.numpy().tolist()} max={biggest.tolist()}")
