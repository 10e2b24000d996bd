"""tf_commstrategy.horovod's Keras half on 2 workers: Horovod scripts with only the import changed, run
through ``tfcs-run``; ``DistributedOptimizer``'s fused all-reduce, gradient aggregation, local variables,
config round trip and ``load_model``; the learning-rate callbacks against Horovod's formulas.

References are computed here, in numpy, from the data the workers report.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, run_workers

RUN = [sys.executable, "-m", "tf_commstrategy.run", "-np", "2", sys.executable]
SIZE = 2


def _run_job(tmp_path, script, *args, timeout=240):
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    r = subprocess.run(RUN + [os.path.join(ROOT, script), "--out", str(out), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r, [json.loads((out / f"rank{k}.json").read_text()) for k in range(SIZE)]


def _mse_grads(x, y, w, b):
    """Gradients of Keras's mean squared error of ``x @ w + b`` (one output) over the batch."""
    residual = x @ w + b - y
    return 2.0 / len(x) * x.T @ residual, 2.0 / len(x) * residual.sum(axis=0)


# -- Horovod's learning-rate formulas, written out as Horovod's callbacks compute them ---------------------------


def _warmup_lr(initial_lr, epoch, batch, steps, warmup_epochs, size=SIZE):
    e = epoch + batch / steps + 1.0 / steps
    return initial_lr / size * (e * (size - 1) / warmup_epochs + 1)


def _fit_schedule(initial_lr, epochs, steps, warmup, start_lr):
    """The rate of every batch of horovod_fit_job.py, and the rate before it (the momentum correction's ratio)."""
    lrs, current = [], start_lr
    for epoch in range(epochs):
        for batch in range(steps):
            new = current
            if epoch < warmup:
                new = _warmup_lr(initial_lr, epoch, batch, steps, warmup)
            elif epoch == warmup and batch == 0:
                new = initial_lr * 1.0 ** (epoch - warmup)
            elif epoch > warmup and batch == 0:
                new = initial_lr * 0.5 ** (epoch - warmup - 1)
            lrs.append((new, current))
            current = new
    return lrs


def _fit_reference(report, run, momentum=0.9, correction=True):
    """horovod_fit_job.py in numpy: averaged-gradient SGD with momentum, each worker's first step from its own
    weights, then rank 0's state everywhere (the broadcast at the end of the first batch)."""
    x, y = np.array(report[0]["x"]), np.array(report[0]["y"])
    shards = [(x[r::SIZE], y[r::SIZE]) for r in range(SIZE)]
    steps = len(shards[0][0]) // 8
    initial_lr = 0.05 * SIZE
    schedule = _fit_schedule(initial_lr, len(report[0]["runs"][run]["lr"]), steps, 2, initial_lr)
    states = [[np.array(rep["runs"][run]["initial"][0]), np.array(rep["runs"][run]["initial"][1]),
               np.zeros((4, 1)), np.zeros(1)] for rep in report]
    for t, (lr, old) in enumerate(schedule):
        b = t % steps
        grads = []
        for r in range(SIZE):
            xb, yb = shards[r][0][b * 8:(b + 1) * 8], shards[r][1][b * 8:(b + 1) * 8]
            w, bias = states[r][:2]
            grads.append(_mse_grads(xb, yb, w, bias))
        gw, gb = np.mean([g[0] for g in grads], 0), np.mean([g[1] for g in grads], 0)
        mom = momentum * (lr / old if correction else 1.0)
        for st in states:  # tf_keras SGD: m = momentum * m - lr * g; w += m
            st[2] = mom * st[2] - lr * gw
            st[3] = mom * st[3] - lr * gb
            st[0] = st[0] + st[2]
            st[1] = st[1] + st[3]
        if t == 0:
            states = [[a.copy() for a in states[0]] for _ in range(SIZE)]
    return states[0][:2], [lr for lr, _ in schedule]


def test_horovod_keras_fit_script_runs_with_only_the_import_changed(tmp_path):
    r, reports = _run_job(tmp_path, "tests/multiprocess/horovod_fit_job.py")
    assert "Epoch 2: finished gradual learning rate warmup to 0.1." in r.stdout
    steps, epochs, initial_lr = 4, 5, 0.1
    for run in ("sgd", "legacy_sgd"):
        got = [rep["runs"][run] for rep in reports]
        for k in range(len(got[0]["final"])):  # identical weights on every worker
            assert np.array_equal(np.array(got[0]["final"][k]), np.array(got[1]["final"][k])), run
        assert got[0]["initial"] != got[1]["initial"]  # they did start apart
        (w, b), lrs = _fit_reference(reports, run)
        np.testing.assert_allclose(np.array(got[0]["final"][0]), w, rtol=2e-4, atol=1e-5, err_msg=run)
        np.testing.assert_allclose(np.array(got[0]["final"][1]), b, rtol=2e-4, atol=1e-5, err_msg=run)
        (w_nc, _), _ = _fit_reference(reports, run, correction=False)  # the momentum correction did matter
        assert np.abs(w_nc - w).max() > 1e-3
        # learning rate per batch and per epoch: Horovod's warmup, then the two schedules
        for g in got:
            np.testing.assert_allclose(g["batch_lrs"], lrs, rtol=1e-6, err_msg=run)
            want_epoch = [_warmup_lr(initial_lr, 0, steps - 1, steps, 2), initial_lr, initial_lr, initial_lr,
                          initial_lr * 0.5]
            np.testing.assert_allclose(g["lr"], want_epoch, rtol=1e-6, err_msg=run)
            assert g["class"] == "SGD" and g["plain_class"] and g["iterations"] == steps * epochs
        # MetricAverageCallback: each worker's own loss differs; the logged loss is their mean, everywhere
        assert got[0]["raw_loss"] != got[1]["raw_loss"]
        np.testing.assert_allclose(got[0]["loss"], np.mean([got[0]["raw_loss"], got[1]["raw_loss"]], 0), rtol=1e-6)
        assert got[0]["loss"] == got[1]["loss"]


def test_horovod_custom_loop_script_runs_with_only_the_import_changed(tmp_path):
    _, reports = _run_job(tmp_path, "tests/multiprocess/horovod_tape_job.py")
    # one fused all-reduce per step after the first (which also broadcasts the model and the optimizer)
    for rep in reports:
        assert rep["counts"][0] > 1 and rep["counts"][1:] == [1] * (len(rep["counts"]) - 1), rep["counts"]
    final = [[np.array(a) for a in rep["final"]] for rep in reports]
    for a, b in zip(*final):
        assert np.array_equal(a, b)
    # numpy: each worker's first step from its own kernel, then rank 0's weights; averaged-gradient SGD
    xs = [np.array(rep["x"]) for rep in reports]
    ys = [np.array(rep["y"]) for rep in reports]
    lr = 0.1 * SIZE
    states = [(np.array(rep["w0"]), np.zeros(1)) for rep in reports]
    for step in range(len(reports[0]["counts"])):
        grads = [_mse_grads(xs[r][step * 8:(step + 1) * 8], ys[r][step * 8:(step + 1) * 8], *states[r])
                 for r in range(SIZE)]
        gw, gb = np.mean([g[0] for g in grads], 0), np.mean([g[1] for g in grads], 0)
        states = [(w - lr * gw, bias - lr * gb) for w, bias in states]
        states = [states[0]] * SIZE
    np.testing.assert_allclose(final[0][0], states[0][0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(final[0][1], states[0][1], rtol=1e-4, atol=1e-6)
    # eager facts: one collective per group; averages; local sources kept and divided by the size
    own = [[np.array(g) for g in rep["own"]] for rep in reports]
    mean = [np.mean([own[0][k], own[1][k]], 0) for k in range(4)]
    for r, rep in enumerate(reports):
        facts = rep["facts"]
        assert facts["grouped"]["collectives"] == 2  # groups=2
        assert facts["by_lists"]["collectives"] == 3  # [v0, v3], then v1 and v2 alone
        assert facts["fp16"]["collectives"] == 1
        for name in ("grouped", "by_lists"):
            for k in range(4):
                np.testing.assert_allclose(facts[name]["grads"][k], mean[k], rtol=1e-5, atol=1e-7)
        for k in range(4):
            np.testing.assert_allclose(facts["fp16"]["grads"][k], mean[k], rtol=2e-3, atol=2e-3)
        local = facts["local"]
        assert local["collectives"] == 1 and local["local_index"] == [1] and local["class"] == "GradientTape"
        np.testing.assert_allclose(local["local"][0], own[r][1] / SIZE, rtol=1e-6)
        for got, k in zip(local["shared"], (0, 2, 3)):
            np.testing.assert_allclose(got, mean[k], rtol=1e-5, atol=1e-7)


def _optimizer_facts(rank, size, tmp):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras as keras3
    import tensorflow as tf
    import tf_keras as keras

    import tf_commstrategy.horovod as hvd
    from tf_commstrategy import UnsupportedOperationError, process
    hvd.init()

    def collectives():  # the host backend's and the compiled all-reduce's (float gradients take it here)
        from tf_commstrategy.tf.native_path import NativeAllReduce
        group = process.default_group()
        native = NativeAllReduce.ready(group)
        return group.backend("grpc").stats().collectives + (native.calls() if native is not None else 0)

    rng = np.random.default_rng(rank)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    y = rng.standard_normal((16, 1)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)

    def model(opt):
        m = keras.Sequential([keras.layers.Dense(1, input_shape=(3,), kernel_initializer="ones",
                                                 bias_initializer="zeros")])
        m.compile(loss="mse", optimizer=opt)
        return m

    facts = {"x": x.tolist(), "y": y.tolist(), "strategy": tf.distribute.has_strategy()}
    # one fused all-reduce per step; groups=2: two
    for name, kwargs, steps in (("plain", {}, 3), ("groups", {"groups": 2}, 2)):
        m = model(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs))
        before = collectives()
        m.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
        facts[name] = collectives() - before
        if name == "plain":
            plain = m
    # backward_passes_per_step=2 with a local bias: 2 all-reduces in 4 steps, every step counted
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    m = model(opt)
    m.build((None, 3))
    opt.register_local_var(m.layers[0].bias)
    before = collectives()
    m.fit(ds, epochs=1, verbose=0)
    facts["aggregated"] = collectives() - before
    facts["aggregated_weights"] = [w.tolist() for w in m.get_weights()]
    facts["iterations"] = int(opt.iterations.numpy())
    # the class: the optimizer's own name, a subclass of it, config round trip, serialized as the plain class
    again = type(opt).from_config(opt.get_config())
    serialized = keras.optimizers.serialize(opt)
    facts["class"] = [type(opt).__name__, isinstance(opt, keras.optimizers.SGD), type(again) is type(opt),
                      again.get_config() == opt.get_config(), again._hvd.settings.backward_passes_per_step,
                      serialized["class_name"], type(keras.optimizers.deserialize(serialized)) is keras.optimizers.SGD]
    rewrapped = hvd.DistributedOptimizer(opt, op=hvd.Sum)
    facts["rewrapped"] = [type(rewrapped).__name__, rewrapped._hvd.settings.op == hvd.Sum,
                          rewrapped._hvd.settings.backward_passes_per_step]
    best = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    facts["best"] = [best.save_best_only, best.monitor, isinstance(best, keras.callbacks.ModelCheckpoint)]
    legacy = hvd.DistributedOptimizer(keras.optimizers.legacy.Adam(0.01))
    facts["legacy"] = [type(legacy).__name__, isinstance(legacy, keras.optimizers.legacy.Adam),
                       isinstance(legacy.variables, list) and callable(legacy.variables)]
    # refusals: Keras 3 optimizers, ops other than Average / Sum
    errors = []
    for make in (lambda: hvd.DistributedOptimizer(keras3.optimizers.SGD(0.1)),
                 lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Min),
                 lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum,
                                                  gradient_predivide_factor=2.0)):
        try:
            make()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - the test checks the type
            errors.append([type(e).__name__, isinstance(e, (UnsupportedOperationError, ValueError)), str(e)])
    facts["errors"] = errors
    # load_model: the saved optimizer, state included, becomes distributed; plain tf_keras loads the file too
    loaded = {}
    for ext in ("keras", "h5"):
        path = os.path.join(tmp, f"rank{rank}.{ext}")
        plain.save(path)
        restored = hvd.load_model(path)
        before = collectives()
        restored.fit(ds, epochs=1, steps_per_epoch=1, verbose=0)
        loaded[ext] = [type(restored.optimizer).__name__, hasattr(restored.optimizer, "register_local_var"),
                       collectives() - before, int(restored.optimizer.iterations.numpy()),
                       type(keras.models.load_model(path).optimizer) is keras.optimizers.SGD]
    facts["load_model"] = loaded
    # the broadcast callback with a worker-local variable: the kernel becomes rank 0's, the bias stays apart
    keras.utils.set_random_seed(50 + rank)
    local = keras.Sequential([keras.layers.Dense(1, input_shape=(3,), bias_initializer="random_normal")])
    local.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    bcast = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local.layers[0].bias)
    local.fit(ds, epochs=1, verbose=0, callbacks=[bcast])
    facts["local_broadcast"] = [w.tolist() for w in local.get_weights()] + [bcast.broadcast_done]
    try:
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[np.ones(1)])
        facts["local_refused"] = None
    except Exception as e:  # noqa: BLE001 - the test checks the type
        facts["local_refused"] = type(e).__name__
    # last (it leaves the group unusable): ranks whose gradients differ in shape get a typed error
    n = 3 + rank
    odd = keras.Sequential([keras.layers.Dense(1, input_shape=(n,))])
    odd.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    try:
        odd.fit(np.ones((4, n)), np.ones((4, 1)), epochs=1, verbose=0)  # hvd.init made fit raise typed errors
        facts["mismatch"] = None
    except Exception as e:  # noqa: BLE001 - the test checks the type
        facts["mismatch"] = [type(e).__name__, str(e)]
    return facts


def test_distributed_optimizer_fuses_aggregates_and_round_trips(tmp_path):
    facts = run_workers(_optimizer_facts, SIZE, str(tmp_path), timeout=240)
    for rank, f in enumerate(facts):
        assert not f["strategy"]
        assert f["plain"] == 3 and f["groups"] == 4
        assert f["aggregated"] == 2 and f["iterations"] == 4
        assert f["class"] == ["SGD", True, True, True, 2, "SGD", True]
        assert f["legacy"] == ["Adam", True, True]
        assert f["rewrapped"] == ["SGD", True, 1] and f["best"] == [True, "loss", True]
        keras3_error, op_error, predivide_error = f["errors"]
        assert keras3_error[0] == "UnsupportedOperationError" and "Keras 3" in keras3_error[2]
        assert "TF_USE_LEGACY_KERAS=1" in keras3_error[2] and "CommStrategy" in keras3_error[2]
        assert op_error[0] == "ConfigurationError" and op_error[1] and "Average and Sum" in op_error[2]
        assert predivide_error[0] == "ConfigurationError"
        for ext in ("keras", "h5"):
            assert f["load_model"][ext] == ["SGD", True, 1, 4, True], (ext, f["load_model"])
        assert f["local_refused"] == "ConfigurationError" and f["local_broadcast"][2] is True
        # the gradients take the compiled all-reduce (hvd.init set it up): its message names this rank's shapes
        assert f["mismatch"][0] == "CollectiveMismatchError", f["mismatch"]
        assert f"2 tensors of shapes [{3 + rank},1], [1]" in f["mismatch"][1], f["mismatch"]
    # backward_passes_per_step=2, averaged: per pair of batches the kernel takes the mean over workers of
    # the mean of the two batches' gradients; each worker's bias its own, divided by the size (local)
    xs = [np.array(f["x"]) for f in facts]
    ys = [np.array(f["y"]) for f in facts]
    w = np.ones((3, 1))
    biases = [np.zeros(1) for _ in range(SIZE)]
    for first in (0, 2):
        gw, gb = [], []
        for r in range(SIZE):
            pairs = [_mse_grads(xs[r][b * 4:(b + 1) * 4], ys[r][b * 4:(b + 1) * 4], w, biases[r])
                     for b in (first, first + 1)]
            gw.append(sum(p[0] for p in pairs))
            gb.append(sum(p[1] for p in pairs))
        w = w - 0.1 * np.mean(gw, 0) / 2
        biases = [biases[r] - 0.1 * gb[r] / SIZE / 2 for r in range(SIZE)]
    for r, f in enumerate(facts):
        np.testing.assert_allclose(f["aggregated_weights"][0], w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(f["aggregated_weights"][1], biases[r], rtol=1e-5, atol=1e-6)
    assert facts[0]["aggregated_weights"][1] != facts[1]["aggregated_weights"][1]
    kernels, biases = ([np.array(f["local_broadcast"][k]) for f in facts] for k in (0, 1))
    assert np.array_equal(kernels[0], kernels[1]) and not np.array_equal(biases[0], biases[1])


def test_horovod_keras_mnist_example_runs_on_two_workers(tmp_path):
    r = subprocess.run(RUN + ["examples/horovod_keras_mnist.py", "--epochs", "1", "--steps-per-epoch", "8",
                              "--train-samples", "1024", "--test-samples", "256", "--checkpoint-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "final: test accuracy" in r.stdout
    assert (tmp_path / "checkpoint-1.h5").exists()


def test_schedule_logic_matches_horovods_formulas():
    from tf_commstrategy.callbacks import logic
    for epoch, batch in ((0, 0), (0, 3), (1, 2), (2, 0)):
        assert logic.horovod_warmup_multiplier(epoch + batch / 4, 4, 3, 4) == pytest.approx(
            _warmup_lr(1.0, epoch, batch, 4, 3, size=4))
    assert logic.horovod_warmup_multiplier(2 + 3 / 4, 4, 3, 4) == pytest.approx(1.0)  # last warmup batch: full
    assert logic.exponential_multiplier(0.1, 30)(32) == pytest.approx(0.01)
    assert logic.schedule_epoch(1, 0, 2, None, True, None) is None
    assert logic.schedule_epoch(2, 0, 2, 5, True, None) == 2.0 and logic.schedule_epoch(2, 1, 2, 5, True, None) is None
    assert logic.schedule_epoch(5, 0, 2, 5, True, None) is None
    assert logic.schedule_epoch(2, 3, 0, None, False, 4) == 2.75
    assert logic.corrected_momentum(0.9, 0.2, 0.1) == pytest.approx(1.8) and logic.corrected_momentum(0.9, 1, 0) == 0.9
    assert logic.steps_from_params({"steps": 7}) == 7 and logic.steps_from_params({"samples": 10, "batch_size": 3}) == 3
    assert logic.steps_from_params({"steps": None}) is None
    a, b = object(), object()
    assert logic.distinct([a, b, a], exclude_ids=[id(b)]) == [a]
