"""Global metrics under model.fit: the metric reads of a train step ride on the gradients' all-reduce
(one collective per step); with a compute_metrics of the user's own, they share one fused collective
of their own (two per step). Logs equal one process's either way."""

import shutil

import numpy as np
import pytest

from tests.helpers import run_workers
from tests.multiprocess import tf_workloads as W

STEPS = 4  # global batch 48 over 192 samples


def _model(keras, custom=False):
    keras.utils.set_random_seed(7)

    class OwnMetrics(keras.Sequential):  # a user's compute_metrics: tf_keras's step order is kept
        def compute_metrics(self, x, y, y_pred, sample_weight):
            return super().compute_metrics(x, y, y_pred, sample_weight)
    m = (OwnMetrics if custom else keras.Sequential)([keras.layers.Dense(16, activation="relu", input_shape=(12,)), keras.layers.Dense(4)])
    m.compile(optimizer=keras.optimizers.SGD(0.05),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")])
    return m


def _fit(rank, size, distributed, custom=False):
    tf = W.setup_tf(1)
    import tf_keras as keras
    if distributed:
        import tf_commstrategy as tfcs
        strategy = tfcs.CommStrategy()
    else:
        strategy = tf.distribute.get_strategy()
    x, y = W.data("mlp")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(W.GLOBAL_BATCH)
    with strategy.scope():
        m = _model(keras, custom)
    out = {}
    if distributed:
        # collectives per train step, whatever fit does once per call (on a model that has only seen the
        # repeated dataset: a train function traced for a finite one adds tf.distribute's per-step
        # "who still has data" agreement)
        from tf_commstrategy.process import default_group
        backend = default_group().backend("grpc")
        native = strategy.extended._native  # on one host: the compiled all-reduce (its calls count too)
        out["native"] = native is not None

        def collectives():
            return backend.stats().collectives + (native.calls() if native is not None else 0)
        counts = []
        m.fit(ds.repeat(), epochs=1, steps_per_epoch=STEPS, verbose=0)
        for steps in (STEPS, 2 * STEPS):
            before = collectives()
            m.fit(ds.repeat(), epochs=1, steps_per_epoch=steps, verbose=0)
            counts.append(collectives() - before)
        out["per_step"] = (counts[1] - counts[0]) / STEPS
        # one stateful graph op per collective (numpy_function: PyFunc; py_function: EagerPyFunc; the compiled
        # all-reduce: TfcsShmAllReduce); the gradients concatenated and split around a callback, or (the
        # compiled op) handed over as they are
        graphs = []
        for f in m.train_tf_function._list_all_concrete_functions():  # pylint: disable=protected-access
            ops = [op.type for op in f.graph.get_operations()]
            g = {k: ops.count(k) for k in ("PyFuncStateless", "ConcatV2", "SplitV", "Split", "TfcsShmAllReduce")}
            g["callbacks"] = ops.count("PyFunc") + ops.count("EagerPyFunc") + ops.count("TfcsShmAllReduce")
            graphs.append(g)
        out["graphs"] = graphs
        with strategy.scope():
            m = _model(keras, custom)
    out.update(history=m.fit(ds, epochs=2, verbose=0).history, eval=m.evaluate(ds, verbose=0))
    return out


@pytest.fixture(scope="module")
def reference():
    return run_workers(_fit, 1, False, timeout=200)[0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("custom,native", [(False, "1"), (True, "1"), (False, "0"), (True, "0")])
def test_metric_reads_share_one_collective_and_stay_global(reference, custom, native):
    if native == "1" and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the compiled all-reduce cannot be built here")
    res = run_workers(_fit, 2, True, custom, timeout=300, env={"TFCS_NATIVE": native})
    for r in res:
        assert r["native"] == (native == "1")
        # default train step: the 6 metric variables (loss, accuracy and top2: total and count each) ride
        # on the fused gradient all-reduce; with the user's compute_metrics, one fused read of their own
        assert r["per_step"] == (2 if custom else 1), r["per_step"]
        for g in r["graphs"]:  # every trace of it
            assert g["callbacks"] == (2 if custom else 1) and g["PyFuncStateless"] == 0, r["graphs"]
            if native == "1":
                assert g["TfcsShmAllReduce"] == g["callbacks"], r["graphs"]
            if native == "1":
                assert g["ConcatV2"] == g["SplitV"] == g["Split"] == 0, r["graphs"]
            else:
                assert g["ConcatV2"] >= 1 and g["SplitV"] >= 1, r["graphs"]
        assert r["graphs"]
        for key in ("loss", "accuracy", "top2"):
            np.testing.assert_allclose(r["history"][key], reference["history"][key], rtol=1e-5, atol=1e-6,
                                       err_msg=key)
        np.testing.assert_allclose(r["eval"], reference["eval"], rtol=1e-5, atol=1e-6)
    assert res[0]["history"] == res[1]["history"] and res[0]["eval"] == res[1]["eval"]
