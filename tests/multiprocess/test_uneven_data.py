"""Workers with different numbers of batches: every worker runs the same number of steps, ends the epoch
at the same step, and the weights match a single-process reference of tf.distribute's rules: a dataset is
batched with the GLOBAL batch (PIECE x workers) and, with auto-sharding off, split into per-replica
pieces that each worker takes in order from its own dataset; Keras counts an epoch in global batches
when it can count them, else runs until every worker is out of data; a worker out of data contributes
an empty batch, i.e. a zero gradient, to the global mean."""

import numpy as np
import pytest

from tests.helpers import run_workers

PIECE, EPOCHS, LR = 2, 2, 0.1   # samples per replica and step; global batch = PIECE x workers


def _data(rank, nb, n):
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((nb * PIECE * n, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    return x, y


def _model(keras):
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.layers.Dense(2, input_shape=(3,))])


def _train(rank, size, nbs, unknown):
    import os
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_keras as keras
    import tf_commstrategy as tfcs
    strategy = tfcs.CommStrategy()
    x, y = _data(rank, nbs[rank], size)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if unknown:
        ds = ds.filter(lambda a, b: True)  # cardinality unknown: nobody can count the batches up front
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    ds = ds.batch(PIECE * size).with_options(opts)
    with strategy.scope():
        m = _model(keras)
        m.compile(keras.optimizers.SGD(LR), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    steps = []

    class Count(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            steps.append(int(m.optimizer.iterations.numpy()))
    h = m.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[Count()])
    return steps, [w for w in m.get_weights()], h.history["loss"]


def _steps(nbs, unknown):
    n = len(nbs)
    return max(nb * n for nb in nbs) if unknown else max(nbs)


def _reference(rank, size, nbs, unknown):
    """One process, plain TF: per step, the mean over workers of each worker's mean-loss gradient (0 if
    that worker is out of data)."""
    import os
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_keras as keras
    m = _model(keras)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    n = len(nbs)
    data = [_data(r, nb, n) for r, nb in enumerate(nbs)]
    for _ in range(EPOCHS):
        for step in range(_steps(nbs, unknown)):
            total = [tf.zeros_like(v) for v in m.trainable_variables]
            for r, (x, y) in enumerate(data):
                if step >= nbs[r] * n:
                    continue  # out of data: an empty batch
                lo = step * PIECE  # worker r's piece number `step` of its own data
                with tf.GradientTape() as tape:
                    lv = loss(y[lo:lo + PIECE], m(x[lo:lo + PIECE]))
                total = [t + g for t, g in zip(total, tape.gradient(lv, m.trainable_variables))]
            for v, g in zip(m.trainable_variables, total):
                v.assign_sub(LR * g / len(nbs))
    return m.get_weights()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nbs,unknown", [((5, 1), False), ((2, 6, 1), False), ((5, 1), True)])
def test_uneven_batches_end_at_the_same_step_and_match_reference(nbs, unknown):
    res = run_workers(_train, len(nbs), nbs, unknown, timeout=200, env={"TFCS_TIMEOUT": "30"})
    ref = run_workers(_reference, 1, nbs, unknown, timeout=120)[0]
    for steps, weights, losses in res:
        # with an unknown count tf_keras's iteration counter also ticks on the end-of-data step of the first
        # epoch (it does so in a single process as well); later epochs use the count it learnt
        first_extra = 1 if unknown else 0
        assert steps == [_steps(nbs, unknown) * (e + 1) + first_extra for e in range(EPOCHS)], steps
        assert all(np.isfinite(losses))
        for w, r0, rr in zip(weights, res[0][1], ref):
            np.testing.assert_array_equal(w, r0)   # identical on every worker
            np.testing.assert_allclose(w, rr, rtol=1e-5, atol=1e-6)
