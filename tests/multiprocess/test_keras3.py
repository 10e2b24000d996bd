"""Keras 3 (``import keras``) under CommStrategy on real workers, against one process on the global batch.

Each worker function runs several small trainings and returns what they produced; the single-process
reference runs the same code under TensorFlow's default strategy. Assertions are made here, in the parent.
"""

import os

import numpy as np
import pytest

from tests.helpers import run_workers
from tests.multiprocess import tf_workloads as W

RTOL, ATOL = 1e-4, 1e-6


def _setup(distributed):
    tf = W.setup_tf(1)
    import keras
    if distributed:
        import tf_commstrategy as tfcs
        return tf, keras, tfcs.CommStrategy()
    return tf, keras, tf.distribute.get_strategy()


def _dataset(tf, kind="mlp"):
    x, y = W.data(kind)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(W.GLOBAL_BATCH)


def _mlp(keras, seed=7, bn=False, **compile_kw):
    keras.utils.set_random_seed(seed)
    L = keras.layers
    layers = [keras.Input((12,)), L.Dense(16, activation="relu")]
    layers += [L.BatchNormalization()] if bn else []
    m = keras.Sequential(layers + [L.Dense(4)])
    compile_kw.setdefault("optimizer", keras.optimizers.SGD(0.05, momentum=0.9))
    m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"], **compile_kw)
    return m


def _weights(m):
    return [np.asarray(w) for w in m.get_weights()]


def _floats(logs):
    return {k: float(np.asarray(v)) for k, v in sorted((logs or {}).items())}


def _fit_logs(keras, m, ds, **fit_kw):
    """fit, recording every train and test batch's logs and the epoch logs."""
    batches = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append(("train", batch, _floats(logs)))

        def on_test_batch_end(self, batch, logs=None):
            batches.append(("test", batch, _floats(logs)))
    h = m.fit(ds, verbose=0, callbacks=[Record()] + fit_kw.pop("callbacks", []), **fit_kw)
    return {"batches": batches, "history": h.history, "weights": _weights(m)}


def _custom_step_model(keras, tf):
    class Custom(keras.Model):
        """A subclassed model with a train_step of its own, written the Keras 3 way."""

        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(16, activation="relu")
            self.out = keras.layers.Dense(4)
            self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            self.mean_loss = keras.metrics.Mean(name="loss")
            self.acc = keras.metrics.SparseCategoricalAccuracy(name="acc")

        def call(self, x):
            return self.out(self.hidden(x))

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                pred = self(x, training=True)
                loss = self.loss_fn(y, pred)  # a Keras 3 loss divides by the replicas in sync itself
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            per_sample = keras.losses.sparse_categorical_crossentropy(y, pred, from_logits=True)
            self.mean_loss.update_state(per_sample)
            self.acc.update_state(y, pred)
            return {"loss": self.mean_loss.result(), "acc": self.acc.result(),
                    "batch_mean": tf.reduce_mean(tf.cast(y, tf.float32))}  # not a metric: averaged over replicas

        @property
        def metrics(self):
            return [self.mean_loss, self.acc]
    keras.utils.set_random_seed(11)
    m = Custom()
    m(np.zeros((1, 12), np.float32))  # builds its layers
    m.compile(optimizer=keras.optimizers.Adam(0.01))
    return m


def _two_in_two_out(keras, tf):
    keras.utils.set_random_seed(5)
    a, b = keras.Input((12,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
    m = keras.Model([a, b], [keras.layers.Dense(4, name="cls")(h), keras.layers.Dense(1, name="reg")(h)])
    m.compile(optimizer=keras.optimizers.Adam(0.01),
              loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
              metrics={"cls": ["accuracy"], "reg": ["mae"]})
    x, y = W.data("mlp")
    extra = x[:, :3] * 0.5
    ds = tf.data.Dataset.from_tensor_slices(({"a": x, "b": extra}, {"cls": y, "reg": x[:, :1] + x[:, 3:4]}))
    return m, ds.batch(W.GLOBAL_BATCH)


def _collectives_per_step(tfcs, strategy, m, ds):
    """Collectives a train step issues (every CommStrategy collective: the grpc backend's sequence and the
    compiled all-reduce's calls), from two fits of different lengths on the repeated dataset (a train
    function traced for a finite dataset adds tf.distribute's per-step "who still has data" agreement)."""
    from tf_commstrategy.process import default_group
    backend = default_group().backend("grpc")
    native = strategy.extended._native

    def count():
        return backend.stats().collectives + (native.calls() if native is not None else 0)
    m.fit(ds.repeat(), epochs=1, steps_per_epoch=2, verbose=0)
    counts = []
    for steps in (4, 8):
        before = count()
        m.fit(ds.repeat(), epochs=1, steps_per_epoch=steps, verbose=0)
        counts.append(count() - before)
    per_step = (counts[1] - counts[0]) / 4
    return per_step, counts[0] - 4 * per_step  # and what a fit issues once (reset, epoch-end reads)


def _training(rank, size, distributed):
    tf, keras, strategy = _setup(distributed)
    ds = _dataset(tf)
    out = {}
    with strategy.scope():
        m = _mlp(keras)
    out["logs"] = _fit_logs(keras, m, ds, epochs=2, validation_data=ds)
    out["logs"]["evaluate"] = m.evaluate(ds, verbose=0, return_dict=True)
    out["logs"]["predict"] = m.predict(ds, verbose=0)

    with strategy.scope():
        m = _mlp(keras, steps_per_execution=2)
    lrs = []
    out["spe"] = _fit_logs(keras, m, ds, epochs=6, validation_data=ds, callbacks=[
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.05),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=0.18),
        keras.callbacks.LambdaCallback(
            on_epoch_end=lambda e, logs: lrs.append(float(m.optimizer.learning_rate.numpy())))])
    out["spe"]["lrs"] = lrs

    with strategy.scope():
        m = _mlp(keras, run_eagerly=True)
    out["eager"] = _fit_logs(keras, m, ds, epochs=1)

    with strategy.scope():
        m = _mlp(keras)
    out["class_weight"] = _fit_logs(keras, m, ds, epochs=1, class_weight={0: 1.0, 1: 2.0, 2: 0.5, 3: 1.5})

    for clip in ("clipnorm", "global_clipnorm"):
        with strategy.scope():
            m = _mlp(keras, optimizer=keras.optimizers.SGD(0.5, **{clip: 0.05}))
        out[clip] = _fit_logs(keras, m, ds, epochs=1)

    with strategy.scope():
        m = _custom_step_model(keras, tf)
    out["custom_step"] = _fit_logs(keras, m, ds, epochs=2)

    with strategy.scope():
        m, ds2 = _two_in_two_out(keras, tf)
    out["two_in_two_out"] = _fit_logs(keras, m, ds2, epochs=2)
    out["two_in_two_out"]["predict"] = m.predict(ds2, verbose=0)

    # a custom training loop: strategy.run with a Keras 3 optimizer, strategy.reduce of the losses
    with strategy.scope():
        m = _mlp(keras)
        opt = keras.optimizers.Adam(0.01)
        opt.build(m.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, m(x, training=True)) / W.GLOBAL_BATCH
            opt.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)
            return loss
        return strategy.reduce("SUM", strategy.run(replica, args=(x, y)), axis=None)
    losses = [float(step(x, y)) for _ in range(2) for x, y in strategy.experimental_distribute_dataset(ds)]
    out["ctl"] = {"losses": losses, "weights": _weights(m), "opt": [np.asarray(v) for v in opt.variables]}

    if distributed:
        import tf_commstrategy as tfcs
        with strategy.scope():
            m = _mlp(keras)
        out["per_step"], out["per_fit"] = _collectives_per_step(tfcs, strategy, m, ds)
        with strategy.scope():
            m = _mlp(keras, bn=True)
        bn = _fit_logs(keras, m, ds, epochs=2)
        out["bn"] = {"weights": bn["weights"], "history": bn["history"]}
        with strategy.scope():  # a model that has seen only the repeated dataset (see _collectives_per_step)
            m = _mlp(keras, bn=True)
        out["bn"]["per_step"], _ = _collectives_per_step(tfcs, strategy, m, ds)
    return out


def _compare(got, ref, what):
    for i, (a, b) in enumerate(zip(got["weights"], ref["weights"])):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"{what}: weight {i}")
    assert got["history"].keys() == ref["history"].keys(), what
    for k in ref["history"]:
        np.testing.assert_allclose(got["history"][k], ref["history"][k], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}: epoch log {k}")
    assert len(got["batches"]) == len(ref["batches"]), what
    for (kind, batch, logs), (rkind, rbatch, rlogs) in zip(got["batches"], ref["batches"]):
        assert (kind, batch) == (rkind, rbatch) and logs.keys() == rlogs.keys(), what
        for k in rlogs:  # the progress bar's numbers: what one process shows at every step
            np.testing.assert_allclose(logs[k], rlogs[k], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{what}: {kind} batch {batch} log {k}")


@pytest.fixture(scope="module")
def reference():
    return run_workers(_training, 1, False, timeout=280)[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_keras3_training_equals_one_process_with_global_logs_at_every_step(reference, size):
    results = run_workers(_training, size, True, timeout=540)
    first = results[0]
    for name in ("logs", "spe", "eager", "class_weight", "clipnorm", "global_clipnorm", "custom_step",
                 "two_in_two_out"):
        for r in range(size):
            _compare(results[r][name], reference[name], f"{name} on rank {r}")
    assert first["spe"]["lrs"] == reference["spe"]["lrs"]  # ReduceLROnPlateau: the same decisions
    assert len(first["spe"]["history"]["loss"]) < 6  # EarlyStopping stopped it, on every rank alike
    assert all(len(r["spe"]["history"]["loss"]) == len(first["spe"]["history"]["loss"]) for r in results)
    np.testing.assert_allclose(first["logs"]["predict"], reference["logs"]["predict"], rtol=RTOL, atol=1e-5)
    for k, v in reference["logs"]["evaluate"].items():
        np.testing.assert_allclose(first["logs"]["evaluate"][k], v, rtol=RTOL, atol=ATOL, err_msg=k)
    for a, b in zip(first["two_in_two_out"]["predict"], reference["two_in_two_out"]["predict"]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-5)
    np.testing.assert_allclose(first["ctl"]["losses"], reference["ctl"]["losses"], rtol=RTOL, atol=ATOL)
    ctl, ref_ctl = first["ctl"], reference["ctl"]
    for a, b in zip(ctl["weights"] + ctl["opt"], ref_ctl["weights"] + ref_ctl["opt"]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg="custom training loop")
    for r in results:
        # the metric state (loss, accuracy: total and count each), and BatchNormalization's moving
        # statistics, ride on the gradients' all-reduce
        assert r["per_step"] == 1 and r["bn"]["per_step"] == 1, (r["per_step"], r["bn"]["per_step"])
        # once per fit: the epoch end reads all metric state in one collective (resetting it issues none)
        assert r["per_fit"] == 1, r["per_fit"]
        # BatchNormalization: every replica normalizes with its own batch; the moving statistics are
        # averaged over replicas when updated, so weights and statistics are identical on every worker
        for a, b in zip(r["bn"]["weights"], first["bn"]["weights"]):
            np.testing.assert_array_equal(a, b)
        assert np.isfinite(r["bn"]["history"]["loss"]).all()
        for a, b in zip(r["logs"]["weights"], first["logs"]["weights"]):
            np.testing.assert_array_equal(a, b)


def _own_shard(tf, rank, batches, scale_first=1.0):
    """This worker's own dataset (no auto-sharding): ``batches`` global batches of W.GLOBAL_BATCH, of which
    the worker's replica takes a piece per step; ``scale_first`` scales the first step's piece."""
    rng = np.random.default_rng(rank)
    n = batches * W.GLOBAL_BATCH
    x = rng.standard_normal((n, 12)).astype(np.float32)
    x[:W.GLOBAL_BATCH // 2] *= scale_first  # 2 workers: a step takes half of a global batch
    y = (x[:, 0] > 0).astype(np.int64)
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(W.GLOBAL_BATCH).with_options(opts)


def _robustness(rank, size, tmp):
    tf, keras, strategy = _setup(True)
    import tf_commstrategy as tfcs
    out = {}
    # mixed_float16: rank 1's first batch overflows float16, the others' do not
    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        m = _mlp(keras)
    m.fit(_own_shard(tf, rank, 4, scale_first=1e6 if rank == 1 else 1.0), epochs=1, verbose=0)
    out["mixed"] = {"optimizer": type(m.optimizer).__name__, "scale": float(m.optimizer.dynamic_scale.numpy()),
                    "iterations": int(m.optimizer.iterations.numpy()), "weights": _weights(m)}
    keras.mixed_precision.set_global_policy("float32")

    # uneven shards: rank r has 3 + 2r batches; every worker runs the largest count of steps (Keras counts
    # global batches when it can; of unknown length, every worker runs until all are out of data)
    for unknown in (False, True):
        with strategy.scope():
            m = _mlp(keras)
        steps = []
        ds = _own_shard(tf, rank, 3 + 2 * rank)
        m.fit(ds.filter(lambda *_: True) if unknown else ds, epochs=2, verbose=0, callbacks=[
            keras.callbacks.LambdaCallback(
                on_epoch_end=lambda e, logs: steps.append(int(m.optimizer.iterations.numpy())))])
        out["uneven_unknown" if unknown else "uneven"] = {"steps": steps, "weights": _weights(m)}

    ds = _dataset(tf)
    # saving on rank 0 alone, in every format and through every entry point
    with strategy.scope():
        m = _mlp(keras)
    m.fit(ds, epochs=1, verbose=0)
    if tfcs.rank() == 0:
        m.save(os.path.join(tmp, "model.keras"))
        m.save_weights(os.path.join(tmp, "model.weights.h5"))
        keras.saving.save_model(m, os.path.join(tmp, "fn.keras"))
        keras.models.save_model(m, os.path.join(tmp, "fn.h5"))
    tfcs.barrier(timeout=180)  # a stray collective on rank 0 would meet this barrier: a mismatch, not a pass
    loaded = [_weights(keras.models.load_model(os.path.join(tmp, name)))
              for name in ("model.keras", "fn.keras", "fn.h5")]
    with strategy.scope():
        fresh = _mlp(keras, seed=99)
    fresh.load_weights(os.path.join(tmp, "model.weights.h5"))
    out["saved"] = {"trained": _weights(m), "loaded": loaded + [_weights(fresh)]}

    # ModelCheckpoint: only the chief writes (each rank is given a directory of its own here)
    with strategy.scope():
        m = _mlp(keras)
    ckpt = os.path.join(tmp, f"ckpt{rank}")
    m.fit(ds, epochs=2, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(
        os.path.join(ckpt, "w{epoch}.weights.h5"), save_weights_only=True),
        keras.callbacks.ModelCheckpoint(os.path.join(ckpt, "best.keras"), monitor="loss", save_best_only=True)])
    out["checkpoints"] = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []

    # BackupAndRestore: interrupted after epoch 2, resumed by a fresh model; only the chief's directory
    # holds a backup, so the other workers take the chief's state and epoch
    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)
            if interrupt and epoch == 2:
                raise RuntimeError("simulated preemption")
    results = []
    for interrupt, backup, seed in ((False, "straight", 0), (True, "resumed", 0), (False, "resumed", 1)):
        epochs = []
        with strategy.scope():  # the resumed model starts elsewhere: its state must come from the backup
            m = _mlp(keras, seed=seed)
        try:
            m.fit(ds, epochs=4, verbose=0, callbacks=[
                keras.callbacks.BackupAndRestore(os.path.join(tmp, f"{backup}{rank}")), Interrupt()])
        except RuntimeError:
            pass
        results.append((epochs, _weights(m)))
    out["backup"] = results
    return out


@pytest.mark.timeout(400)
def test_keras3_mixed_precision_uneven_data_saving_and_checkpoints(tmp_path):
    results = run_workers(_robustness, 2, str(tmp_path), timeout=360)
    first = results[0]
    for r, res in enumerate(results):
        # mixed_float16: one worker's overflow skips the step on every worker (the all-reduced gradients
        # decide), the loss scale halves once everywhere, and nothing hangs
        mixed = res["mixed"]
        assert mixed["optimizer"] == "LossScaleOptimizer" and mixed["scale"] == 32768.0 / 2, mixed
        assert mixed["iterations"] == 3, mixed  # the overflowing step applied no update
        for a, b in zip(mixed["weights"], first["mixed"]["weights"]):
            np.testing.assert_array_equal(a, b)
            assert np.isfinite(a).all()
        # uneven shards (3 and 5 global batches): 5 steps per epoch on both workers; of unknown length, the
        # 10 per-replica pieces of the longer shard, plus the call that finds every worker out of data, which
        # Keras 3 counts as an iteration (it does so in one process too: its increment does not wait for data)
        assert res["uneven"]["steps"] == [5, 10] and res["uneven_unknown"]["steps"] == [11, 22], res
        for key in ("uneven", "uneven_unknown"):
            for a, b in zip(res[key]["weights"], first[key]["weights"]):
                np.testing.assert_array_equal(a, b)
        for loaded in res["saved"]["loaded"]:  # rank 0's files, read by every worker
            for a, b in zip(loaded, first["saved"]["trained"]):
                np.testing.assert_array_equal(a, b)
        assert res["checkpoints"] == (["best.keras", "w1.weights.h5", "w2.weights.h5"] if r == 0 else []), res
        (straight_epochs, straight), (cut_epochs, _), (resumed_epochs, resumed) = res["backup"]
        assert straight_epochs == [0, 1, 2, 3] and cut_epochs == [0, 1, 2] and resumed_epochs == [2, 3], res["backup"]
        for a, b in zip(resumed, straight):  # resumed at the interrupted epoch, nothing lost
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _callbacks(rank, size, with_strategy):
    """tfcs.callbacks on Keras 3 models, under CommStrategy or with a plain per-worker strategy."""
    tf = W.setup_tf(1)
    import keras
    import tf_commstrategy as tfcs
    strategy = tfcs.CommStrategy() if with_strategy else tf.distribute.get_strategy()
    if not with_strategy:
        tfcs.init()
    x, y = W.data("mlp")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(size, rank).batch(W.GLOBAL_BATCH // size)
    with strategy.scope():
        m = _mlp(keras, seed=rank, optimizer=keras.optimizers.Adam(0.01))  # every worker starts elsewhere
        m.optimizer.build(m.trainable_variables)
    local, lrs, start = [], [], []
    record_start = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: start.extend(
        _weights(m) + [np.asarray(v) for v in m.optimizer.variables]))
    record_local = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: local.append(dict(logs)))
    record_lr = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda b, logs: lrs.append(float(m.optimizer.learning_rate.numpy())))
    warmup = tfcs.callbacks.LearningRateWarmupCallback(0.02, warmup_epochs=2)
    h = m.fit(ds, epochs=3, verbose=tfcs.callbacks.verbosity(), callbacks=[
        tfcs.callbacks.BroadcastGlobalVariablesCallback(0), record_start, warmup, record_local, record_lr,
        tfcs.callbacks.MetricAverageCallback()])
    return {"start": start, "weights": _weights(m), "opt": [np.asarray(v) for v in m.optimizer.variables],
            "local": local,
            "history": h.history, "lrs": lrs, "steps": warmup.steps_per_epoch}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("with_strategy", [False, True])
def test_keras3_models_take_tfcs_callbacks(with_strategy):
    from tf_commstrategy.callbacks import logic
    results = run_workers(_callbacks, 2, with_strategy, timeout=240)
    first = results[0]
    for r in results:
        assert len(r["start"]) == len(first["start"]) > 4
        for a, b in zip(r["start"], first["start"]):  # rank 0's weights and optimizer state everywhere
            np.testing.assert_array_equal(a, b)
        if with_strategy:  # then the same steps everywhere (without it, each worker trains alone)
            for a, b in zip(r["weights"] + r["opt"], first["weights"] + first["opt"]):
                np.testing.assert_array_equal(a, b)
        assert r["history"]["loss"] == first["history"]["loss"]  # averaged epoch logs, identical
        steps = r["steps"]
        expected = [0.02 * logic.warmup_multiplier(e + b / steps, 2, 2) for e in range(2) for b in range(steps)]
        np.testing.assert_allclose(r["lrs"][:len(expected)], expected, rtol=1e-6)
        assert r["lrs"][len(expected):] == [pytest.approx(0.02)] * steps
    for e in range(3):  # each epoch's logged loss: the mean of the workers' own (equal under CommStrategy)
        mean = np.mean([r["local"][e]["loss"] for r in results])
        np.testing.assert_allclose(first["history"]["loss"][e], mean, rtol=1e-6)
    if not with_strategy:
        assert results[0]["local"][0]["loss"] != results[1]["local"][0]["loss"]  # local metrics did differ
