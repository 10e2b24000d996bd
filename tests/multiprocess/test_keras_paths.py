"""tf_keras features under CommStrategy on 2 real workers (assertions in the parent)."""

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


def _model(keras, strategy, seed, bn=True, **compile_kw):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        layers = [keras.layers.Dense(8, activation="relu", input_shape=(10,))]
        if bn:
            layers.append(keras.layers.BatchNormalization())
        layers.append(keras.layers.Dense(2))
        m = keras.Sequential(layers)
        m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **compile_kw)
    return m


def _data(tf, n=256, batch=32):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 10)).astype(np.float32)
    y = (x.sum(1) > 0).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _scenario(rank, size, which, tmp):
    tf, keras, tfcs = _setup()
    strategy = tfcs.CommStrategy()
    ds = _data(tf)
    if which == "steps_per_execution_validation":
        m = _model(keras, strategy, rank, steps_per_execution=3)
        return m.fit(ds, epochs=2, verbose=0, validation_data=ds).history, [w.tolist() for w in m.get_weights()[:1]]
    if which == "steps_per_execution_reads":
        return _counter_reads(keras, strategy, m=_model(keras, strategy, rank, steps_per_execution=2), ds=ds)
    if which == "run_eagerly":
        m = _model(keras, strategy, rank, run_eagerly=True)
        return m.fit(ds, epochs=1, verbose=0).history, [w.tolist() for w in m.get_weights()[:1]]
    if which == "mixed_precision":
        keras.mixed_precision.set_global_policy("mixed_float16")
        m = _model(keras, strategy, rank)
        h = m.fit(ds, epochs=1, verbose=0).history
        return h, type(m.optimizer).__name__, [w.tolist() for w in m.get_weights()[:1]]
    if which == "early_stopping":
        m = _model(keras, strategy, rank)
        cb = keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)
        return len(m.fit(ds, epochs=20, verbose=0, validation_data=ds, callbacks=[cb]).history["loss"])
    if which == "model_checkpoint":
        m = _model(keras, strategy, rank)
        m.fit(ds, epochs=2, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(
            os.path.join(tmp, "ckpt", "w.{epoch}.h5"), save_weights_only=True)])
        tfcs.barrier()
        return sorted(os.listdir(os.path.join(tmp, "ckpt")))
    if which == "save_on_rank0":
        m = _model(keras, strategy, rank)
        m.fit(ds, epochs=1, verbose=0)
        formats = ["model.h5", "model.keras", "saved_model"]  # h5, tf_keras's default, SavedModel
        functions = ["fn.keras", "fn_saved_model", "tf_saved_model"]  # the same through functions
        if tfcs.rank() == 0:  # the common idiom: only rank 0 saves
            for name in formats:  # .keras and SavedModel read the metrics' state as well
                m.save(os.path.join(tmp, name))
            m.save_weights(os.path.join(tmp, "weights.h5"))
            m.save_weights(os.path.join(tmp, "weights_tf"))
            keras.models.save_model(m, os.path.join(tmp, "fn.keras"))
            keras.saving.save_model(m, os.path.join(tmp, "fn_saved_model"), save_format="tf")
            tf.saved_model.save(m, os.path.join(tmp, "tf_saved_model"))
        formats += functions
        # a stray collective on rank 0 would meet this barrier: a mismatch at once, not a pass; the barrier's
        # own deadline covers rank 0's saving (SavedModel tracing takes 10-20 s on a loaded 2-core machine)
        tfcs.barrier(timeout=180)
        restored = [[w.tolist() for w in keras.models.load_model(os.path.join(tmp, name)).get_weights()[:2]]
                    for name in formats if name != "tf_saved_model"]
        plain = tf.saved_model.load(os.path.join(tmp, "tf_saved_model"))  # no Keras metadata: TF's own loader
        restored.append([v.numpy().tolist() for v in plain.variables if v.shape == (10, 8)])  # the first kernel
        return restored, [w.tolist() for w in m.get_weights()[:2]]
    if which == "metrics_outside_scope":
        m = _model(keras, strategy, rank)
        m.fit(ds, epochs=1, verbose=0)  # each worker trains on its own shard: local metrics differ
        outside = {k: float(v) for k, v in m.get_metrics_result().items()}
        with strategy.scope():
            inside = {k: float(v) for k, v in m.get_metrics_result().items()}
        return outside, inside, {mt.name: float(mt.result()) for mt in m.metrics}
    if which == "jit_compile":
        m = _model(keras, strategy, rank, jit_compile=True)
        try:
            m.fit(ds, epochs=1, verbose=0)
        except Exception as e:  # noqa: BLE001
            return type(e).__name__, str(e)
        return "no error", ""
    raise ValueError(which)


def _counter_reads(keras, strategy, m, ds):
    """How often each ``fit`` reads the steps-per-execution counter through the MirroredVariable (a
    cross-replica read), for 4 and 8 steps; then a fit of 5 steps (executions of 2, 2 and 1: the handler
    assigns the counter and restores it): the batches its callbacks saw and the counter afterwards."""
    from tensorflow.python.distribute import values
    counter = m._steps_per_execution  # pylint: disable=protected-access
    reads = []
    original = values.MirroredVariable._get_cross_replica

    def counting(self):
        if self is counter:
            reads.append(1)
        return original(self)

    per_fit = []
    values.MirroredVariable._get_cross_replica = counting
    try:
        m.fit(ds.repeat(), epochs=1, steps_per_epoch=2, verbose=0)  # the train function made (reads of its own)
        for steps in (4, 8):
            before = len(reads)
            m.fit(ds.repeat(), epochs=1, steps_per_epoch=steps, verbose=0)
            per_fit.append(len(reads) - before)
    finally:
        values.MirroredVariable._get_cross_replica = original
    ends = []
    m.fit(ds.repeat(), epochs=1, steps_per_epoch=5, verbose=0, callbacks=[
        keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: ends.append(batch))])
    return (type(counter).__name__, per_fit, ends, int(counter.numpy()),
            [int(v.numpy()) for v in counter.values])


def test_steps_per_execution_counter_is_read_from_its_first_component(tmp_path):
    """tf_keras reads the counter at every step; a mirrored read costs 4x a plain one (keras_compat)."""
    for kind, per_fit, ends, after, components in run_workers(_scenario, 2, "steps_per_execution_reads",
                                                              str(tmp_path), timeout=240):
        assert kind == "MirroredVariable"
        assert per_fit[0] == per_fit[1], per_fit  # not once per execution (2 and 4 executions)
        assert ends == [1, 3, 4]  # executions of 2, 2 and the partial 1
        assert after == 2 and components == [2]  # restored through the variable after the partial one


@pytest.mark.parametrize("which", ["steps_per_execution_validation", "run_eagerly", "mixed_precision"])
def test_training_variants_agree_across_workers(which, tmp_path):
    res = run_workers(_scenario, 2, which, str(tmp_path), timeout=240)
    assert res[0] == res[1]
    hist = res[0][0]
    assert all(np.isfinite(v).all() for v in hist.values())
    if which == "steps_per_execution_validation":
        assert set(hist) == {"loss", "accuracy", "val_loss", "val_accuracy"} and len(hist["loss"]) == 2
    if which == "mixed_precision":
        assert res[0][1] == "LossScaleOptimizerV3"


def test_early_stopping_stops_every_worker_at_the_same_epoch(tmp_path):
    assert run_workers(_scenario, 2, "early_stopping", str(tmp_path), timeout=240) == [2, 2]


def test_model_checkpoint_chief_writes_others_clean_up(tmp_path):
    files = run_workers(_scenario, 2, "model_checkpoint", str(tmp_path), timeout=240)
    assert files[0] == files[1] == ["w.1.h5", "w.2.h5"]  # no worker temp dirs left behind


def test_save_on_rank0_only_works_without_hanging(tmp_path):
    res = run_workers(_scenario, 2, "save_on_rank0", str(tmp_path), timeout=240, env={"TFCS_TIMEOUT": "30"})
    for restored, live in res:
        assert len(restored) == 6  # 3 formats through Model.save, 3 through save functions
        for weights in restored:  # every format: what rank 0 saved is the shared model
            np.testing.assert_allclose(weights[0], res[0][1][0])


def test_metrics_read_outside_the_scope_are_global(tmp_path):
    res = run_workers(_scenario, 2, "metrics_outside_scope", str(tmp_path), timeout=240)
    (out0, in0, res0), (out1, in1, res1) = res
    assert set(out0) == {"loss", "accuracy"}
    for k in out0:
        assert out0[k] == in0[k] == out1[k] == in1[k], (k, res)
    assert in0["accuracy"] == res0["accuracy"] == res1["accuracy"]


def test_jit_compile_is_refused_with_a_clear_error(tmp_path):
    for name, msg in run_workers(_scenario, 2, "jit_compile", str(tmp_path), timeout=240):
        assert "cannot run inside an XLA-compiled function" in msg and "jit_compile=False" in msg


def _backup(rank, size, tmp, interrupt_at):
    tf, keras, tfcs = _setup()
    strategy = tfcs.CommStrategy()
    ds = _data(tf)
    m = _model(keras, strategy, 5, bn=False)
    epochs_run = []

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs_run.append(epoch)
            if interrupt_at is not None and epoch == interrupt_at:
                raise RuntimeError("simulated preemption")

    try:
        m.fit(ds, epochs=4, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(os.path.join(tmp, "backup")),
                                                  Interrupt()])
        done = True
    except RuntimeError:
        done = False
    return done, epochs_run, [w.tolist() for w in m.get_weights()]


def test_backup_and_restore_resumes_after_interruption_with_nothing_lost(tmp_path):
    (_, _, straight), _ = run_workers(_backup, 2, str(tmp_path / "a"), None, timeout=240)
    first = run_workers(_backup, 2, str(tmp_path / "b"), 2, timeout=240)
    assert [f[0] for f in first] == [False, False] and first[0][1] == [0, 1, 2]
    second = run_workers(_backup, 2, str(tmp_path / "b"), None, timeout=240)  # a fresh job, same backup dir
    for done, epochs_run, weights in second:
        assert done and epochs_run == [2, 3]  # resumed at the interrupted epoch
        for a, b in zip(weights, straight):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _sparse(rank, size):
    tf, keras, tfcs = _setup()
    strategy = tfcs.CommStrategy()

    def fn():
        ctx = tf.distribute.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        values = tf.fill([2, 3], tf.cast(rid + 1, tf.float32))
        indices = tf.constant([0, 4]) + tf.cast(rid, tf.int32)
        s = tf.IndexedSlices(values, indices, dense_shape=tf.constant([6, 3]))
        out = ctx.all_reduce(tf.distribute.ReduceOp.SUM, s)
        return out
    out = tf.function(lambda: strategy.run(fn))()
    return type(out).__name__, tf.convert_to_tensor(out).numpy().tolist()


def test_indexed_slices_are_all_gathered_and_sum_like_dense():
    size = 2
    want = np.zeros((6, 3))
    for r in range(size):
        want[[0 + r, 4 + r]] += r + 1
    for kind, dense in run_workers(_sparse, size, timeout=120):
        assert kind == "IndexedSlices"  # stayed sparse end to end
        np.testing.assert_array_equal(dense, want)
