"""A single-CPU-replica worker reads its shard through a plain tf.data iterator (tf/input_path.py)."""

import numpy as np

from tests.helpers import run_workers


def _faults_per_big_alloc():
    """Minor page faults (this thread) per 2.5 MiB numpy allocation, after a warm-up one: 641 measured
    when glibc maps every large block afresh (M_MMAP_THRESHOLD pinned low by TensorFlow's
    GeneratorDataset kernel), 64 when it reuses its heap."""
    import resource
    np.ones(640 << 10, np.float32)
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(10):
        a = np.ones(640 << 10, np.float32)
        del a
    return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0) / 10


def _spec_builds_per_call(tf, strategy, it):
    """Calls a tf.function with the distributed iterator 4 times: how many per-worker iterator specs
    (``_SingleWorkerDatasetIteratorSpec``) each of the last 3 calls built, the function's traces, and
    the first element of each call's global batch."""
    from tensorflow.python.distribute import input_lib
    spec_class = input_lib._SingleWorkerDatasetIteratorSpec  # pylint: disable=protected-access
    original = spec_class.__init__
    built = []

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    @tf.function
    def first(iterator):
        return strategy.gather(next(iterator)[0], axis=0)[0, 0]

    firsts = [float(first(it))]
    spec_class.__init__ = counting
    try:
        firsts += [float(first(it)) for _ in range(3)]
    finally:
        spec_class.__init__ = original
    return {"per_call": len(built) / 3, "traces": first.experimental_get_tracing_count(), "firsts": firsts,
            "same_spec": it._type_spec is it._type_spec}  # pylint: disable=protected-access


def _fit(rank, size, local_devices):
    from tests.multiprocess.tf_workloads import setup_tf
    tf = setup_tf(local_devices)
    import tf_keras as keras
    import tf_commstrategy as tfcs
    from tensorflow.python.data.ops import iterator_ops
    strategy = tfcs.CommStrategy(devices=[f"/cpu:{i}" for i in range(local_devices)])
    x = np.arange(96, dtype=np.float32).reshape(96, 1)
    ds = tf.data.Dataset.from_tensor_slices((x, 2 * x)).batch(24)
    dist = strategy.experimental_distribute_dataset(ds)
    it = iter(dist)
    inner = it._iterators[0]._iterator  # pylint: disable=protected-access
    seen = [strategy.gather(b[0], axis=0).numpy().ravel().tolist() for b in dist]
    specs = _spec_builds_per_call(tf, strategy, iter(dist))
    with strategy.scope():
        m = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        m.compile(optimizer="sgd", loss="mse")
    m.fit(ds, epochs=2, verbose=0)
    return {"plain": isinstance(inner, iterator_ops.OwnedIterator), "kind": type(inner).__name__,
            "batches": seen, "faults": _faults_per_big_alloc(), "specs": specs}


def test_one_cpu_replica_uses_a_plain_iterator_and_keeps_mallocs_policy():
    res = run_workers(_fit, 2, 1, timeout=180)
    for r in res:
        assert r["plain"], r["kind"]
        assert r["faults"] < 300, r["faults"]  # TF's GeneratorDataset patch (M_MMAP_THRESHOLD) not applied
        # the iterator's type specs are made once, not at every call of the train function
        assert r["specs"]["per_call"] == 0 and r["specs"]["same_spec"], r["specs"]
        assert r["specs"]["traces"] == 1 and r["specs"]["firsts"] == [0.0, 24.0, 48.0, 72.0], r["specs"]
    # the global batches are the dataset's, in order, split across the workers as tf.distribute does
    expected = [list(map(float, range(i, i + 24))) for i in range(0, 96, 24)]
    assert res[0]["batches"] == res[1]["batches"] == expected


def test_several_replicas_keep_the_multi_device_iterator():
    res = run_workers(_fit, 2, 2, timeout=180)
    for r in res:
        assert not r["plain"] and "MultiDeviceIterator" in r["kind"], r["kind"]
        # TensorFlow's own behaviour, left alone: the specs are made at each call
        assert r["specs"]["per_call"] >= 1 and not r["specs"]["same_spec"], r["specs"]
        assert r["specs"]["traces"] == 1 and r["specs"]["firsts"] == [0.0, 24.0, 48.0, 72.0], r["specs"]
    expected = [list(map(float, range(i, i + 24))) for i in range(0, 96, 24)]
    # replica order interleaves the rebatched sub-batches of the two workers (as under MWMS)
    assert res[0]["batches"] == res[1]["batches"]
    assert [sorted(b) for b in res[0]["batches"]] == expected
