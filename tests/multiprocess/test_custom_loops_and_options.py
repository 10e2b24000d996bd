"""Custom training loops, the direct API on tf.Tensors, and per-call backend selection."""

import numpy as np
import pytest

from tests.helpers import run_workers


def _setup(local_devices=1):
    from tests.multiprocess.tf_workloads import setup_tf
    tf = setup_tf(local_devices)
    import tf_commstrategy as tfcs
    return tf, tfcs


def _ctl(rank, size):
    tf, tfcs = _setup(local_devices=2)
    strategy = tfcs.CommStrategy(devices=["/cpu:0", "/cpu:1"])
    out = {}
    # ReplicaContext.all_reduce and strategy.reduce / gather over per-replica values
    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        rid = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, rid + 1.0), tf.reshape(rid, [1])
    s, ids = tf.function(lambda: strategy.run(replica_fn))()
    out["all_reduce"] = [float(v) for v in strategy.experimental_local_results(s)]
    out["gather"] = strategy.gather(ids, axis=0).numpy().tolist()
    out["reduce_mean"] = float(strategy.reduce(tf.distribute.ReduceOp.MEAN, ids, axis=None).numpy()[0])
    # experimental_distribute_values_from_function gives global replica ids
    vals = strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant([ctx.replica_id_in_sync_group]))
    out["values_from_fn"] = strategy.gather(vals, axis=0).numpy().tolist()
    # gradients through ReplicaContext.all_reduce
    with strategy.scope():
        w = tf.Variable(2.0)

    @tf.function
    def grad_step():
        def fn():
            with tf.GradientTape() as tape:
                y = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, w * w)
            return tape.gradient(y, w)
        return strategy.run(fn)
    out["grad"] = [float(g) for g in strategy.experimental_local_results(grad_step())]
    # a GradientTape training loop over a distributed dataset; per-replica batches are disjoint
    x = np.arange(48, dtype=np.float32).reshape(48, 1)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(12)
    dist = strategy.experimental_distribute_dataset(ds)
    with strategy.scope():
        v = tf.Variable(0.0)

    @tf.function
    def train_step(batch):
        def fn(b):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((v - b) ** 2) / 12.0
            g = tape.gradient(loss, v)
            g = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, g)
            v.assign_sub(0.01 * g)
            return tf.reduce_sum(b)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(fn, args=(batch,)), axis=None)
    seen = [float(train_step(b)) for b in dist]
    out["ctl_batch_sums"] = seen
    out["ctl_v"] = float(v.numpy())
    # distribute_datasets_from_function: each worker its own pipeline
    def dataset_fn(ctx):
        return tf.data.Dataset.range(8).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(
            ctx.get_per_replica_batch_size(8))
    dfn = strategy.distribute_datasets_from_function(dataset_fn)
    first = next(iter(dfn))
    out["dfn_first"] = strategy.gather(first, axis=0).numpy().tolist()
    # MEAN of values that are not per-replica: one value per worker, so the mean over the workers
    mine = tf.constant([float(rank + 1)])
    out["mean_plain"] = float(strategy.reduce(tf.distribute.ReduceOp.MEAN, mine, axis=None).numpy()[0])
    out["mean_batch"] = [float(t.numpy()[0]) for t in strategy.extended.batch_reduce_to(
        tf.distribute.ReduceOp.MEAN, [(mine, "/cpu:0"), (mine * 10, "/cpu:0")])]
    const = tf.constant(4.0)
    rc = tf.function(lambda: strategy.run(
        lambda: tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN, const)))()
    out["mean_replica_ctx"] = [float(x) for x in strategy.experimental_local_results(rc)]
    with strategy.scope():  # a MEAN-aggregated variable: every replica adds 1, the mean adds 1
        m = tf.Variable(0.0, aggregation=tf.VariableAggregation.MEAN)
    tf.function(lambda: strategy.run(lambda: m.assign_add(1.0)))()
    out["mean_variable"] = float(m.numpy())
    return out


def test_custom_training_loop_primitives_cross_workers():
    size, local = 2, 2
    res = run_workers(_ctl, size, timeout=240)
    n = size * local
    for r in res:
        assert r == res[0]
    out = res[0]
    assert out["all_reduce"] == [n * (n + 1) / 2] * local
    assert out["gather"] == list(range(n))
    assert out["reduce_mean"] == pytest.approx(np.mean(range(n)))
    assert out["values_from_fn"] == list(range(n))
    assert out["grad"] == [2 * 2.0 * n] * local  # d/dw of sum over replicas of w^2, summed again
    x = np.arange(48, dtype=np.float32)
    assert out["ctl_batch_sums"] == [float(x[i:i + 12].sum()) for i in range(0, 48, 12)]
    # single-process reference of the same loop on the global batch (numpy)
    v = 0.0
    for i in range(0, 48, 12):
        b = x[i:i + 12]
        v -= 0.01 * float(np.sum(2 * (v - b)) / 12.0)
    assert out["ctl_v"] == pytest.approx(v, rel=1e-5)
    # each worker's pipeline is its own shard: together the first global batch holds all 8 elements
    assert sorted(out["dfn_first"]) == list(range(8))
    assert out["mean_plain"] == pytest.approx(1.5)  # (1 + 2) / 2 workers, not / 4 replicas
    assert out["mean_batch"] == pytest.approx([1.5, 15.0])
    assert out["mean_replica_ctx"] == [4.0] * local  # tf.distribute.MirroredStrategy gives 4.0 too
    assert out["mean_variable"] == pytest.approx(1.0)


def _direct_tensors(rank, size):
    tf, tfcs = _setup()
    tfcs.init()
    t = tf.constant([1.0, 2.0]) * (rank + 1)
    eager = tfcs.allreduce(t).numpy().tolist()

    @tf.function
    def f(x):
        return tfcs.allreduce(x, op="max"), tfcs.broadcast(x, root_rank=1), tfcs.allgather(x[:rank + 1])
    m, b, g = f(t)
    return eager, m.numpy().tolist(), b.numpy().tolist(), g.numpy().tolist(), isinstance(m, tf.Tensor)


def test_direct_api_accepts_tensors_eagerly_and_in_tf_function():
    for eager, mx, b, g, is_tensor in run_workers(_direct_tensors, 2, timeout=120):
        assert eager == [3.0, 6.0] and mx == [2.0, 4.0] and b == [2.0, 4.0] and g == [1.0, 2.0, 4.0]
        assert is_tensor


def _per_call(rank, size):
    tf, tfcs = _setup()
    from tf_commstrategy.process import default_group
    strategy = tfcs.CommStrategy(backend="grpc")
    grpc = default_group().backend("grpc")
    native = strategy.extended._native  # on one host the grpc backend's all-reduces run as a compiled op

    def grpc_calls():  # collectives on the grpc backend: its Python calls and its compiled ones
        return grpc.stats().collectives + (native.calls() if native is not None else 0)
    CO = tf.distribute.experimental.CommunicationOptions
    Impl = tf.distribute.experimental.CommunicationImplementation
    x = tf.constant([float(rank + 1)])
    pr = strategy.experimental_distribute_values_from_function(lambda ctx: x)
    out = {}
    before = grpc_calls()
    r = strategy.extended.reduce_to(tf.distribute.ReduceOp.SUM, pr, destinations="/cpu:0",
                                options=CO(implementation=Impl.RING))
    out["ring"] = (float(r.numpy()[0]), grpc_calls() - before)
    for name, opts in [("nccl_tf", CO(implementation=Impl.NCCL)), ("nccl_ours", tfcs.CommOptions(backend="nccl"))]:
        try:
            strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(pr, "/cpu:0")], options=opts)
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    before = grpc_calls()
    r = strategy.extended.reduce_to(tf.distribute.ReduceOp.MEAN, pr, destinations="/cpu:0",
                                    options=tfcs.CommOptions(backend="grpc", timeout_seconds=5))
    out["ours_grpc"] = (float(r.numpy()[0]), grpc_calls() - before)
    # TensorFlow's "zero disables the timeout": the job's deadline here, not an instant timeout
    r = strategy.extended.reduce_to(tf.distribute.ReduceOp.SUM, pr, destinations="/cpu:0",
                                    options=CO(implementation=Impl.RING, timeout_seconds=0))
    out["timeout 0"] = float(r.numpy()[0])
    try:
        strategy.extended.reduce_to(tf.distribute.ReduceOp.SUM, pr, destinations="/cpu:0",
                                    options=CO(timeout_seconds=-1))
        out["timeout -1"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["timeout -1"] = type(e).__name__
    out["after"] = float(strategy.extended.reduce_to(tf.distribute.ReduceOp.SUM, pr, destinations="/cpu:0").numpy()[0])
    return out


def test_per_call_options_reach_the_matching_backend():
    for out in run_workers(_per_call, 2, timeout=120, expect_failure=True).values():
        kind, out = out
        assert kind == "ok", out
        assert out["ring"] == (3.0, 1)  # one collective on the grpc backend
        assert out["ours_grpc"] == (1.5, 1)
        assert out["timeout 0"] == 3.0 and out["timeout -1"] == "ConfigurationError" and out["after"] == 3.0, out
        for k in ("nccl_tf", "nccl_ours"):
            assert "BackendUnavailableError" in out[k] and "backend 'nccl' cannot run here" in out[k], out[k]
            assert "cupy" in out[k] or "GPU" in out[k]


def _unwrap(rank, size):
    import os
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_commstrategy as tfcs
    tfcs.init(timeout=30)

    @tf.function
    def step(x):
        return tfcs.allreduce(x)

    step(tf.ones([3]))  # fine
    try:
        with tfcs.unwrap_errors():
            step(tf.ones([3 + rank]))  # ranks disagree on the shape
    except tfcs.CollectiveMismatchError as e:
        return "typed", isinstance(e.__cause__, tf.errors.OpError)
    except tf.errors.OpError:
        return "tf error", False
    return "no error", False


def test_unwrap_errors_gives_the_typed_error_in_a_custom_loop():
    assert run_workers(_unwrap, 2, timeout=120) == [("typed", True)] * 2


def _per_call_transport(rank, size):
    import os
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_commstrategy as tfcs
    strategy = tfcs.CommStrategy(communication_options=tfcs.CommOptions(transport="unix"))
    from tf_commstrategy.process import default_group
    used = default_group().backend("grpc").transport

    def fn(v, options):
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce("sum", v, options=options)
    same = strategy.run(fn, args=(tf.constant([1.0 + rank]), tfcs.CommOptions(transport="unix")))
    try:
        strategy.run(fn, args=(tf.constant([1.0]), tfcs.CommOptions(transport="tcp")))
        other = "accepted"
    except tfcs.ConfigurationError as e:
        other = str(e)
    # a strategy whose default is TF's own CommunicationOptions checks a call's CommOptions(transport=) too
    plain = tfcs.CommStrategy(communication_options=tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=30))
    try:
        plain.run(fn, args=(tf.constant([1.0]), tfcs.CommOptions(transport="tcp")))
        other_plain = "accepted"
    except tfcs.ConfigurationError as e:
        other_plain = str(e)
    # after init: a strategy with its own deadline and the job's transport (any spelling) joins the job as
    # it is; another transport is refused by the same rule as a call's
    later = tfcs.CommStrategy(timeout=60, communication_options=tfcs.CommOptions(transport=" UNIX"))
    later_value = later.run(fn, args=(tf.constant([2.0]), None))
    try:
        tfcs.CommStrategy(communication_options=tfcs.CommOptions(transport="tcp"))
        later_other = "accepted"
    except tfcs.ConfigurationError as e:
        later_other = str(e)
    return (used, float(strategy.experimental_local_results(same)[0].numpy()[0]), other, other_plain,
            float(later.experimental_local_results(later_value)[0].numpy()[0]), later_other)


def test_transport_from_strategy_options_and_per_call_check():
    for used, value, other, other_plain, later_value, later_other in run_workers(_per_call_transport, 2,
                                                                                 timeout=120):
        assert used == "unix" and value == 3.0
        assert "transport" in other and "when the job started" in other
        assert "when the job started" in other_plain, other_plain
        assert later_value == 4.0
        assert "after tfcs.init()" in later_other and "'tcp'" in later_other, later_other


def _nccl_default_on_host(rank, size, how):
    import os
    if how == "env":
        os.environ["TFCS_BACKEND"] = "nccl"
    tf, tfcs = _setup()
    import tf_keras as keras
    if how == "backend":
        strategy = tfcs.CommStrategy(backend="nccl")
    elif how == "options":  # what MultiWorkerMirroredStrategy users write
        strategy = tfcs.CommStrategy(communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.NCCL))
    else:
        strategy = tfcs.CommStrategy()
    x = np.random.default_rng(rank).standard_normal((96, 4)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(16)  # finite: TF reduces partial-batch counts
    with strategy.scope():
        m = keras.Sequential([keras.layers.Dense(1, input_shape=(4,))])
        m.compile(optimizer="sgd", loss="mse")
    h = m.fit(ds, epochs=2, verbose=0)
    # a host tensor with nccl named on the call itself is refused, with the fix
    try:
        strategy.extended.reduce_to("SUM", tf.constant([1.0]), "/cpu:0", options=tfcs.CommOptions(backend="nccl"))
        refused = "no error"
    except tfcs.TfcsError as e:
        refused = type(e).__name__
    return len(h.history["loss"]), m.get_weights()[0].ravel().tolist(), refused


@pytest.mark.parametrize("how", ["backend", "options", "env"])
def test_nccl_as_the_default_leaves_host_tensors_to_the_ring(how):
    (n0, w0, refused0), (n1, w1, refused1) = run_workers(_nccl_default_on_host, 2, how, timeout=240)
    assert n0 == n1 == 2 and w0 == w1  # trained in sync, through the ring
    # no GPU here: nccl named on the call is refused (no cupy: BackendUnavailableError)
    assert refused0 in ("BackendUnavailableError", "UnsupportedOperationError"), refused0


def _strategy_timeout_after_init(rank, size):
    tf, tfcs = _setup()
    from tf_commstrategy.errors import ConfigurationError
    tfcs.init()
    s = tfcs.CommStrategy(timeout=7)  # joined already: the strategy's own deadline, not a second init
    t = tfcs.CommStrategy(timeout=9, communication_options=tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=30, bytes_per_pack=1024))
    try:
        tfcs.CommStrategy(timeout=-1)
        bad = "no error"
    except ConfigurationError:
        bad = "ConfigurationError"
    x = s.experimental_distribute_values_from_function(lambda ctx: tf.constant([float(rank + 1)]))
    r = s.reduce(tf.distribute.ReduceOp.SUM, x, axis=None)
    return (s.extended._communication_options.timeout_seconds, t.extended._communication_options.timeout_seconds,
            t.extended._communication_options.bytes_per_pack, bad, float(r.numpy()[0]))


def test_strategy_timeout_after_init_is_the_strategys_deadline():
    for out in run_workers(_strategy_timeout_after_init, 2, timeout=120):
        assert out == (7.0, 9.0, 1024, "ConfigurationError", 3.0), out
