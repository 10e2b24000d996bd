"""The Keras callbacks on 2 real workers; references computed independently in the parent."""

import os

import numpy as np
import pytest

from tests.helpers import run_workers


def _setup():
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import tf_keras as keras
    import tf_commstrategy as tfcs
    return tf, keras, tfcs


def _data(tf, n=128, batch=32, noise_seed=0):
    rng = np.random.default_rng(noise_seed)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = (x[:, 0] + 0.3 * rng.standard_normal(n) > 0).astype(np.int64)
    return x, y, tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _model(keras, lr=0.01):
    m = keras.Sequential([keras.layers.Dense(5, activation="tanh", input_shape=(6,)), keras.layers.Dense(2)])
    m.compile(optimizer=keras.optimizers.Adam(lr), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m


def _broadcast(rank, size, use_callback):
    tf, keras, tfcs = _setup()
    strategy = tfcs.CommStrategy()
    _, _, ds = _data(tf)
    with strategy.scope():
        m = _model(keras)
        m.optimizer.build(m.trainable_variables)
    # as if a checkpoint (weights and optimizer state) had been loaded on each rank separately
    rng = np.random.default_rng(1000 + rank)
    m.set_weights([rng.standard_normal(w.shape).astype(w.dtype) for w in m.get_weights()])
    for v in m.optimizer.variables[1:]:
        v.assign(rng.random(v.shape).astype(v.dtype.as_numpy_dtype))
    root_weights = [w.copy() for w in m.get_weights()]
    cbs = [tfcs.callbacks.BroadcastGlobalVariablesCallback(0)] if use_callback else []
    h1 = m.fit(ds, epochs=1, steps_per_epoch=1, verbose=0, callbacks=cbs)
    after_first = ([w for w in m.get_weights()], [v.numpy() for v in m.optimizer.variables])
    h2 = m.fit(ds, epochs=3, verbose=0, callbacks=cbs)  # fit called again
    return root_weights, after_first, h1.history["loss"] + h2.history["loss"]


@pytest.mark.parametrize("use_callback", [True, False])
def test_broadcast_callback_makes_weights_and_optimizer_state_identical(use_callback):
    (root0, first0, loss0), (root1, first1, loss1) = run_workers(_broadcast, 2, use_callback, timeout=240)
    assert not all(np.array_equal(a, b) for a, b in zip(root0, root1))  # they did start apart
    same = all(np.array_equal(a, b) for a, b in zip(first0[0] + first0[1], first1[0] + first1[1]))
    if use_callback:
        assert same and loss0 == loss1
    else:  # the control: without the callback the divergent states survive
        assert not same



def _broadcast_unbuilt(rank, size, legacy):
    tf, keras, tfcs = _setup()
    strategy = tfcs.CommStrategy()
    _, _, ds = _data(tf)
    keras.utils.set_random_seed(100 + rank)  # every rank starts from different weights
    with strategy.scope():  # no input shape: nothing is built until the first batch
        m = keras.Sequential([keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(2)])
        opt = keras.optimizers.legacy.Adam(0.01) if legacy else keras.optimizers.Adam(0.01)
        m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = tfcs.callbacks.BroadcastGlobalVariablesCallback(0)
    built_at_start = m.built
    m.fit(ds, epochs=2, verbose=0, callbacks=[cb])
    opt_vars = m.optimizer.variables() if legacy else m.optimizer.variables
    return built_at_start, cb.broadcasts, m.get_weights(), [v.numpy() for v in opt_vars]


@pytest.mark.parametrize("legacy", [False, True], ids=["optimizer", "legacy-optimizer"])
def test_broadcast_callback_on_a_model_built_by_its_first_batch(legacy):
    (built0, n0, w0, o0), (built1, n1, w1, o1) = run_workers(_broadcast_unbuilt, 2, legacy, timeout=240)
    assert not built0 and not built1 and n0 == n1 == 1
    # the first step ran from different weights; the broadcast after it, then identical gradients
    assert len(w0) == 4 and len(o0) > 1
    for a, b in zip(w0 + o0, w1 + o1):
        np.testing.assert_array_equal(a, b)


def _metric_average(rank, size):
    tf, keras, tfcs = _setup()
    strategy = tfcs.CommStrategy(sync_metrics=False)
    _, _, ds = _data(tf)
    keras.utils.set_random_seed(7)
    with strategy.scope():
        m = _model(keras, lr=0.0)  # frozen: epoch metrics are plain means over each worker's shard
    raw = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raw.append(dict(logs))

    seen_after = []

    class After(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen_after.append(dict(logs))

    h = m.fit(ds, epochs=2, verbose=0, validation_data=ds,
              callbacks=[Record(), tfcs.callbacks.MetricAverageCallback(), After()])
    return raw, seen_after, h.history


def _reference_metrics(rank, size):
    tf, keras, _ = _setup()
    _, _, ds = _data(tf)
    keras.utils.set_random_seed(7)
    m = _model(keras, lr=0.0)
    return m.evaluate(ds, verbose=0)


def test_metric_average_with_local_metrics_equals_global_mean():
    (ref_loss, ref_acc), = run_workers(_reference_metrics, 1, timeout=120)
    res = run_workers(_metric_average, 2, timeout=240)
    (raw0, after0, hist0), (raw1, after1, hist1) = res
    assert raw0[0]["loss"] != raw1[0]["loss"]  # local metrics really differ per worker
    for after, hist in ((after0, hist0), (after1, hist1)):
        for logs in after:
            assert logs["loss"] == pytest.approx(ref_loss, rel=1e-5)
            assert logs["val_loss"] == pytest.approx(ref_loss, rel=1e-5)
            assert logs["accuracy"] == pytest.approx(ref_acc, rel=1e-5)
        assert hist["loss"] == [a["loss"] for a in after]  # History (last callback) saw averaged values
    assert after0 == after1


def _global_metrics_and_warmup(rank, size):
    """Two fits under one CommStrategy: global metrics with MetricAverageCallback, then the warm-up."""
    tf, keras, tfcs = _setup()
    strategy = tfcs.CommStrategy()
    _, _, ds = _data(tf)  # 4 batches per epoch
    with strategy.scope():
        m = _model(keras)
    raw = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raw.append(dict(logs))

    h = m.fit(ds, epochs=2, verbose=0, callbacks=[Record(), tfcs.callbacks.MetricAverageCallback()])
    with strategy.scope():
        w = _model(keras)
    lrs = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            lrs.append(float(w.optimizer.learning_rate.numpy()))

    w.fit(ds, epochs=4, verbose=0, callbacks=[tfcs.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2),
                                              Probe()])
    return raw, h.history, lrs


@pytest.fixture(scope="module")
def global_metrics_and_warmup():
    return run_workers(_global_metrics_and_warmup, 2, timeout=240)


def test_metric_average_with_global_metrics_changes_nothing(global_metrics_and_warmup):
    for raw, hist, _ in global_metrics_and_warmup:
        assert hist["loss"] == [r["loss"] for r in raw]


def _early_stop(rank, size):
    tf, keras, tfcs = _setup()
    strategy = tfcs.CommStrategy(sync_metrics=False)
    _, _, ds = _data(tf, noise_seed=rank)  # different data per worker: local val_loss diverge
    with strategy.scope():
        m = _model(keras, lr=0.05)
    cb = [tfcs.callbacks.MetricAverageCallback(),
          keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.01)]
    h = m.fit(ds, epochs=30, verbose=0, validation_data=ds, callbacks=cb)
    return len(h.history["loss"])


def test_early_stopping_after_metric_average_stops_all_workers_together():
    a, b = run_workers(_early_stop, 2, timeout=240)
    assert a == b and a < 30


def test_warmup_learning_rate_follows_the_closed_form(global_metrics_and_warmup):
    size, steps = 2, 4
    for _, _, lrs in global_metrics_and_warmup:
        want = []
        for epoch in range(4):
            for b in range(steps):
                e = epoch + b / steps
                want.append(0.4 / size * (e * (size - 1) / 2 + 1) if e < 2 else 0.4)
        np.testing.assert_allclose(lrs, want, rtol=1e-6)


def _warmup_steps(rank, size):
    tf, keras, tfcs = _setup()
    x, y, ds = _data(tf)  # 4 batches of 32
    m = _model(keras)
    cb = tfcs.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2)
    m.fit(ds, epochs=1, verbose=0, callbacks=[cb])
    first = cb.steps_per_epoch
    m.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])  # the next fit has 8 batches an epoch
    second = cb.steps_per_epoch
    unknown = tf.data.Dataset.from_generator(lambda: iter(zip(x, y)), output_signature=(
        tf.TensorSpec((6,), tf.float32), tf.TensorSpec((), tf.int64))).batch(32)
    try:
        m.fit(unknown, epochs=1, verbose=0, callbacks=[cb])
        refused = "no error"
    except tfcs.ConfigurationError as e:
        refused = str(e)
    given = tfcs.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2, steps_per_epoch=4)
    m.fit(unknown, epochs=1, verbose=0, callbacks=[given])
    return first, second, refused, given.steps_per_epoch


def test_warmup_reads_each_fits_epoch_length_and_refuses_an_unknown_one():
    (first, second, refused, given), = run_workers(_warmup_steps, 1, timeout=120)
    assert (first, second, given) == (4, 8, 4)
    assert "steps=None" in refused and "steps_per_epoch=" in refused, refused
