"""Horovod's TensorFlow collectives (``tf_commstrategy.horovod``) in real workers, after Horovod's own TF2
parallel tests (test/parallel/test_tensorflow.py): every result is compared here, in the parent, with a
numpy reference built from the same seeded inputs, never with the code under test.

Three jobs: values (2 workers, eagerly and inside ``tf.function``), gradients (2 workers), and 3 workers
for uneven splits, ``join`` and a mismatch (ranks calling different collectives).
"""

import numpy as np
import pytest

from tests.helpers import run_workers

AVG, SUM, ADASUM, MIN, MAX, PROD = 0, 1, 2, 3, 4, 5  # Horovod's values (horovod/common/message.h)
DTYPES = ["float16", "float32", "float64", "int32", "int64"]
OPS = [AVG, SUM, MIN, MAX, PROD]
TOL = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-12, "int32": 0, "int64": 0, "bool": 0}


def _x(rank, dtype, shape, seed, op=SUM):
    """Rank ``rank``'s input: small integers (negatives included: integer averages truncate toward
    zero) for integer and float16 dtypes, else in [-1, 1); near 1 for products."""
    rng = np.random.default_rng([seed, rank, DTYPES.index(dtype) if dtype in DTYPES else 9, op])
    if op == PROD:
        if dtype.startswith("int"):
            return rng.choice(np.array([1, 1, 2, -1]), shape).astype(dtype)
        return rng.uniform(0.8, 1.25, shape).astype(dtype)
    if dtype.startswith("int"):
        return rng.integers(-50, 50, shape).astype(dtype)
    if dtype == "float16":
        return rng.integers(-8, 8, shape).astype(dtype)
    return (rng.random(shape) * 2 - 1).astype(dtype)


def _scale_ref(x, factor):
    """Horovod's scaling: floats in their dtype (float16 through float32), integers through float64,
    truncated toward zero."""
    if factor == 1.0:
        return x
    if x.dtype.kind == "f":
        wide = np.float64 if x.dtype == np.float64 else np.float32
        return (x.astype(wide) * wide(factor)).astype(x.dtype)
    return np.trunc(x.astype(np.float64) * factor).astype(x.dtype)


def _reduce_ref(xs, op, pre=1.0, post=1.0):
    """Horovod's all-reduce of ``xs`` (one array per rank) in numpy: Average is a sum scaled by 1/size."""
    dt, n = xs[0].dtype, len(xs)
    xs = np.stack([_scale_ref(x, pre) for x in xs])
    wide = xs.astype(np.float64) if dt.kind == "f" else xs
    if op in (SUM, AVG):
        r = wide.sum(0)
    else:
        r = {MIN: wide.min, MAX: wide.max, PROD: wide.prod}[op](0)
    if op == AVG and dt.kind == "f":
        return _scale_ref((r / n).astype(dt), post)
    if op == AVG:
        return _scale_ref(r.astype(dt), post / n)
    return _scale_ref(r.astype(dt), post)


def _close(got, want, dtype, what):
    assert got.dtype == np.dtype(want.dtype), (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    tol = TOL[np.dtype(dtype).name]
    if tol == 0:
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol,
                                   err_msg=what)


def _setup():
    import os
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import tf_commstrategy.horovod as hvd
    hvd.init()
    return tf, hvd


def _error(fn):
    """The class name and message of what ``fn()`` raises ("no error" if nothing)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the parent checks the class
        return type(e).__name__, str(e)
    return "no error", ""


# ---------------------------------------------------------------------------------------------- values


def _values_worker(rank, size):
    import time
    tf, hvd = _setup()
    from tf_commstrategy.horovod import ops as hops
    out = {"who": (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                   hvd.cross_size(), hvd.is_homogeneous(), hvd.is_initialized(), hvd.global_process_set.ranks,
                   hvd.global_process_set.size(), hvd.global_process_set.included())}
    out["who_ops"] = [int(t) for t in tf.function(lambda: [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(),
                                                           hvd.local_size_op(), hvd.process_set_included_op()])()]
    # every dtype x op, eagerly; tf.Variable inputs too
    for dtype in DTYPES:
        for op in OPS:
            x = _x(rank, dtype, (3, 5), 1, op)
            out[("allreduce", dtype, op)] = hvd.allreduce(tf.constant(x), op=op).numpy()
            out[("allreduce var", dtype, op)] = hvd.allreduce(tf.Variable(x), op=op).numpy()
    out["bool"] = [hvd.allreduce(tf.constant([True, rank == 0, False]), op=op).numpy() for op in (MIN, MAX)]
    x = _x(rank, "float32", (4,), 2)
    out["average flag"] = [hvd.allreduce(tf.constant(x), average=a).numpy() for a in (True, False)]
    out["default op"] = hvd.allreduce(tf.constant(x)).numpy()
    out["keras form"] = hvd.allreduce([1.0 + rank, 2.0], "a_name").numpy()
    for dtype in ("float32", "float64", "float16", "int32"):
        for op in (SUM, AVG):
            xs = _x(rank, dtype, (6,), 3)
            out[("scaled", dtype, op)] = hvd.allreduce(tf.constant(xs), op=op, prescale_factor=0.5,
                                                       postscale_factor=3.0).numpy()
    # grouped (fused) allreduce of mixed dtypes, eagerly and in a tf.function
    g_in = [_x(rank, "float32", (4,), 4), _x(rank, "int32", (2, 3), 4), _x(rank, "float64", (5,), 4)]
    out["grouped"] = {op: [t.numpy() for t in hvd.grouped_allreduce([tf.constant(a) for a in g_in], op=op)]
                      for op in (AVG, SUM, MAX)}
    out["grouped fn"] = [t.numpy() for t in tf.function(
        lambda a, b, c: hvd.grouped_allreduce([a, b, c], op=SUM))(*[tf.constant(a) for a in g_in])]
    out["grouped empty"] = hvd.grouped_allreduce([])
    # tf.IndexedSlices: the gradient of a gather, gathered (values, indices) and averaged
    emb = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))
    idx = tf.constant([rank, rank + 2, rank + 2])
    w = tf.constant(_x(rank, "float32", (3, 2), 5))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(emb, idx) * w)
    sl = tape.gradient(loss, emb)
    out["slices"] = {}
    for op in (SUM, AVG):
        r = hvd.allreduce(sl, op=op)
        out["slices"][op] = (type(r).__name__, r.values.numpy(), r.indices.numpy(), tf.convert_to_tensor(r).numpy())
    mixed = hvd.grouped_allreduce([sl, w], op=AVG)
    out["slices grouped"] = (type(mixed[0]).__name__, tf.convert_to_tensor(mixed[0]).numpy(), mixed[1].numpy())
    out["slices errors"] = [_error(lambda: hvd.allreduce(sl, op=MAX)),
                            _error(lambda: hvd.allreduce(sl, prescale_factor=2.0))]
    # allgather: first dimensions differ between ranks
    rows = _x(rank, "float32", (rank + 2, 3), 6)
    out["allgather"] = hvd.allgather(tf.constant(rows)).numpy()
    out["allgather int64"] = hvd.allgather(tf.constant(_x(rank, "int64", (rank + 1,), 6))).numpy()
    out["allgather fn"] = tf.function(lambda t: hvd.allgather(t))(tf.constant(rows)).numpy()
    out["grouped allgather"] = [t.numpy() for t in hvd.grouped_allgather(
        [tf.constant(rows), tf.constant(_x(rank, "int32", (3 - rank, 2), 6))])]
    # broadcast, and broadcast_ in place
    b = _x(rank, "float64", (2, 3), 7)
    out["broadcast"] = [hvd.broadcast(tf.constant(b), root).numpy() for root in (0, 1)]
    out["broadcast bool"] = hvd.broadcast(tf.constant([rank == 1, rank == 0]), 1).numpy()
    v1, v2 = tf.Variable(_x(rank, "float32", (3,), 8)), tf.Variable(_x(rank, "int32", (2, 2), 8))
    returned = hvd.broadcast_([v1, v2], 1)
    out["broadcast_"] = ([r.numpy() for r in returned], [v1.numpy(), v2.numpy()])
    v3 = tf.Variable(_x(rank, "float32", (4,), 9))
    tf.function(lambda: hvd.broadcast_([v3], 0))()
    out["broadcast_ fn"] = v3.numpy()
    out["root errors"] = [_error(lambda: hvd.broadcast(tf.constant(b), 2)),
                          _error(lambda: hvd.broadcast(tf.constant(b), -1))]
    # reducescatter: 9 rows over 2 ranks (5 and 4), Sum and Average, integers, scale factors
    for dtype in ("float32", "int32", "float16"):
        for op in (SUM, AVG):
            xs = _x(rank, dtype, (9, 2), 10)
            out[("reducescatter", dtype, op)] = hvd.reducescatter(tf.constant(xs), op=op).numpy()
    xs = _x(rank, "float32", (9, 2), 10)
    out["reducescatter scaled"] = hvd.reducescatter(tf.constant(xs), op=SUM, prescale_factor=0.5,
                                                    postscale_factor=3.0).numpy()
    out["reducescatter default"] = hvd.reducescatter(tf.constant(xs)).numpy()
    out["reducescatter fn"] = tf.function(lambda t: hvd.reducescatter(t, op=SUM))(tf.constant(xs)).numpy()
    out["grouped reducescatter"] = [t.numpy() for t in hvd.grouped_reducescatter(
        [tf.constant(xs), tf.constant(_x(rank, "float64", (4, 3), 10))], op=SUM)]
    out["reducescatter errors"] = [_error(lambda: hvd.reducescatter(tf.constant(1.0)))]
    # fp16 compression: all-reduces hand the core float32 tensors and its "fp16" compression (the bytes
    # it then sends: tests/multiprocess/test_compression.py); reduce-scatter casts to float16 in the
    # graph; the result comes back in float32
    seen = []
    real_allreduce, real_rs = hops._core_allreduce, hops._core_reduce_scatter
    hops._core_allreduce = lambda ts, op, wire=None: seen.append(("allreduce", [t.dtype.name for t in ts], wire)) \
        or real_allreduce(ts, op, wire)
    hops._core_reduce_scatter = lambda t, op: seen.append(("reducescatter", [t.dtype.name])) or real_rs(t, op)
    try:
        c = _x(rank, "float32", (6,), 11) * 100
        out["fp16"] = hvd.allreduce(tf.constant(c), compression=hvd.Compression.fp16).numpy()
        out["fp16 none"] = hvd.allreduce(tf.constant(c), compression=hvd.Compression.none).numpy()
        out["fp16 grouped"] = [t.numpy() for t in hvd.grouped_allreduce(
            [tf.constant(c), tf.constant(_x(rank, "int32", (3,), 11))], op=SUM, compression=hvd.Compression.fp16)]
        out["fp16 reducescatter"] = hvd.reducescatter(tf.constant(xs.astype(np.float64)), op=SUM,
                                                      compression=hvd.Compression.fp16).numpy()
        out["fp16 fn"] = tf.function(lambda t: hvd.allreduce(t, op=SUM, compression=hvd.Compression.fp16))(
            tf.constant(c)).numpy()
    finally:
        hops._core_allreduce, hops._core_reduce_scatter = real_allreduce, real_rs
    out["wire"] = seen
    # objects and variables
    out["broadcast_object"] = hvd.broadcast_object({"from": rank, "list": [rank] * 3}, root_rank=1)
    out["broadcast_object_fn"] = hvd.broadcast_object_fn(root_rank=0)(("tuple", rank))
    out["allgather_object"] = hvd.allgather_object({"rank": rank, "text": "x" * (rank * 1000)})
    out["object in fn"] = _error(lambda: tf.function(lambda: hvd.broadcast_object(1) or tf.constant(0))())
    vs = [tf.Variable(_x(rank, "float32", (2, 2), 12)), tf.Variable(_x(rank, "int64", (3,), 12))]
    out["broadcast_variables eager"] = hvd.broadcast_variables(vs, root_rank=1)
    out["broadcast_variables"] = [v.numpy() for v in vs]
    vs2 = [tf.Variable(_x(rank, "float64", (3,), 13)), tf.Variable(_x(rank, "float32", (1,), 13))]

    @tf.function
    def broadcast_in_fn():
        hvd.broadcast_variables(vs2, root_rank=0, inplace=True)
    broadcast_in_fn()
    out["broadcast_variables fn"] = [v.numpy() for v in vs2]
    import keras  # Keras 3's variables, which Keras 3 models hold: no tf.Variable, no read_value()
    kvs = [keras.Variable(_x(rank, "float32", (2, 3), 16)), keras.Variable(_x(rank, "int32", (2,), 16))]
    hvd.broadcast_variables(kvs, root_rank=1)
    out["keras variables"] = [np.asarray(v.numpy()) for v in kvs]

    # twenty independent all-reduces of different tensors (dtypes, shapes, ops) in ONE tf.function
    @tf.function
    def twenty(a, b):
        return [hvd.allreduce((a if i % 2 == 0 else b)[: i % 7 + 1] + i, op=OPS[i % 5]) for i in range(20)]
    a20, b20 = _x(rank, "float32", (8,), 14), _x(rank, "int32", (8,), 14)
    out["twenty"] = [t.numpy() for t in twenty(tf.constant(a20), tf.constant(b20))]
    out["twenty again"] = [t.numpy() for t in twenty(tf.constant(a20 * 2), tf.constant(b20 * 2))]

    # every kind of collective in one tf.function, run twice
    @tf.function
    def mixed_fn(x, r):
        return (hvd.allreduce(x, op=SUM), hvd.allgather(r), hvd.broadcast(x * 2.0, root_rank=1),
                hvd.reducescatter(tf.concat([x, x, x[:1]], 0), op=SUM),
                *hvd.grouped_allreduce([x, tf.cast(x, tf.float64)], op=MAX), *hvd.grouped_allgather([r, r[:1]]),
                hvd.join())
    mx, mr = _x(rank, "float32", (3,), 15), _x(rank, "float32", (rank + 1, 2), 15)
    out["mixed"] = [[t.numpy() for t in mixed_fn(tf.constant(mx), tf.constant(mr))] for _ in range(2)]
    # barrier and join: the ranks meet; join says who came last
    hvd.barrier()
    if rank == 0:
        time.sleep(0.8)
    out["join"] = int(hvd.join())
    barrier_fn = tf.function(lambda: hvd.barrier() or tf.constant(0))
    barrier_fn.get_concrete_function()  # traced now; the timing below is the op alone
    hvd.barrier()
    if rank == 0:
        time.sleep(1.5)
    t0 = time.monotonic()
    barrier_fn()
    out["barrier wait"] = time.monotonic() - t0
    return out


@pytest.fixture(scope="module")
def values():
    return run_workers(_values_worker, 2, timeout=240)


def test_rank_size_local_and_cross(values):
    for rank, out in enumerate(values):
        # both workers on this host: local rank = rank, one host
        assert out["who"] == (rank, 2, rank, 2, 0, 1, True, True, [0, 1], 2, True)
        assert out["who_ops"] == [rank, 2, rank, 2, 1]


def test_allreduce_every_dtype_and_op(values):
    for dtype in DTYPES:
        for op in OPS:
            want = _reduce_ref([_x(r, dtype, (3, 5), 1, op) for r in range(2)], op)
            for out in values:
                _close(out[("allreduce", dtype, op)], want, dtype, f"{dtype} op {op}")
                _close(out[("allreduce var", dtype, op)], want, dtype, f"variable {dtype} op {op}")
    # integer averages truncate toward zero (Horovod's scaling): the inputs hold odd negative sums, where a
    # floor would give one less
    sums = sum(_x(r, "int32", (3, 5), 1, AVG).astype(np.int64) for r in range(2))
    assert ((sums % 2 == 1) & (sums < 0)).any()
    for out in values:
        np.testing.assert_array_equal(out["bool"][0], [True, False, False])  # min: logical and
        np.testing.assert_array_equal(out["bool"][1], [True, True, False])  # max: logical or


def test_average_flag_default_op_and_keras_form(values):
    xs = [_x(r, "float32", (4,), 2) for r in range(2)]
    for out in values:
        _close(out["average flag"][0], _reduce_ref(xs, AVG), "float32", "average=True")
        _close(out["average flag"][1], _reduce_ref(xs, SUM), "float32", "average=False")
        _close(out["default op"], _reduce_ref(xs, AVG), "float32", "default op is Average")
        _close(out["keras form"], np.array([1.5, 2.0], np.float32), "float32", "allreduce(value, name)")


def test_prescale_and_postscale(values):
    for dtype in ("float32", "float64", "float16", "int32"):
        for op in (SUM, AVG):
            xs = [_x(r, dtype, (6,), 3) for r in range(2)]
            want = _reduce_ref(xs, op, pre=0.5, post=3.0)
            for out in values:
                _close(out[("scaled", dtype, op)], want, dtype, f"scaled {dtype} op {op}")


def test_grouped_allreduce(values):
    ins = [[_x(r, "float32", (4,), 4), _x(r, "int32", (2, 3), 4), _x(r, "float64", (5,), 4)] for r in range(2)]
    for out in values:
        for op in (AVG, SUM, MAX):
            for i, d in enumerate(("float32", "int32", "float64")):
                _close(out["grouped"][op][i], _reduce_ref([ins[r][i] for r in range(2)], op), d, f"grouped {op} {i}")
        for i, d in enumerate(("float32", "int32", "float64")):
            _close(out["grouped fn"][i], _reduce_ref([ins[r][i] for r in range(2)], SUM), d, f"grouped fn {i}")
        assert out["grouped empty"] == []


def test_indexed_slices_are_gathered(values):
    ws = [_x(r, "float32", (3, 2), 5) for r in range(2)]
    idxs = [np.array([r, r + 2, r + 2]) for r in range(2)]
    dense = np.zeros((6, 2), np.float32)
    for w, i in zip(ws, idxs):
        np.add.at(dense, i, w)
    for out in values:
        for op, div in ((SUM, 1), (AVG, 2)):
            kind, vals, ind, as_dense = out["slices"][op]
            assert kind == "IndexedSlices"
            _close(vals, np.concatenate(ws) / np.float32(div), "float32", "slices values")
            np.testing.assert_array_equal(ind, np.concatenate(idxs))
            _close(as_dense, dense / np.float32(div), "float32", "slices dense")
        kind, as_dense, dense_part = out["slices grouped"]
        assert kind == "IndexedSlices"
        _close(as_dense, dense / 2, "float32", "grouped slices")
        _close(dense_part, _reduce_ref(ws, AVG), "float32", "grouped dense beside slices")
        (c1, m1), (c2, m2) = out["slices errors"]
        assert c1 == "UnsupportedOperationError" and "Only Sum and Average" in m1
        assert c2 == "UnsupportedOperationError" and "Pre/postscale_factor" in m2


def test_allgather_with_different_first_dims(values):
    rows = np.concatenate([_x(r, "float32", (r + 2, 3), 6) for r in range(2)])
    ints = np.concatenate([_x(r, "int64", (r + 1,), 6) for r in range(2)])
    second = np.concatenate([_x(r, "int32", (3 - r, 2), 6) for r in range(2)])
    for out in values:
        _close(out["allgather"], rows, "float32", "allgather")
        _close(out["allgather fn"], rows, "float32", "allgather in tf.function")
        _close(out["allgather int64"], ints, "int64", "allgather int64")
        _close(out["grouped allgather"][0], rows, "float32", "grouped allgather 0")
        _close(out["grouped allgather"][1], second, "int32", "grouped allgather 1")


def test_broadcast_and_broadcast_in_place(values):
    for out in values:
        for root in (0, 1):
            _close(out["broadcast"][root], _x(root, "float64", (2, 3), 7), "float64", f"broadcast from {root}")
        np.testing.assert_array_equal(out["broadcast bool"], [True, False])
        returned, held = out["broadcast_"]
        for got in (returned, held):
            _close(got[0], _x(1, "float32", (3,), 8), "float32", "broadcast_ float32")
            _close(got[1], _x(1, "int32", (2, 2), 8), "int32", "broadcast_ int32")
        _close(out["broadcast_ fn"], _x(0, "float32", (4,), 9), "float32", "broadcast_ in tf.function")
        for cls, msg in out["root errors"]:
            assert cls == "ConfigurationError" and "is not a rank of this job of 2" in msg, msg


def test_reducescatter_uneven(values):
    for dtype in ("float32", "int32", "float16"):
        for op in (SUM, AVG):
            full = _reduce_ref([_x(r, dtype, (9, 2), 10) for r in range(2)], op)
            for rank, out in enumerate(values):
                _close(out[("reducescatter", dtype, op)], np.array_split(full, 2)[rank], dtype, f"rs {dtype} {op}")
    xs = [_x(r, "float32", (9, 2), 10) for r in range(2)]
    xs64 = [_x(r, "float64", (4, 3), 10) for r in range(2)]
    for rank, out in enumerate(values):
        assert out[("reducescatter", "float32", SUM)].shape == ((5, 2) if rank == 0 else (4, 2))
        mine = lambda a: np.array_split(a, 2)[rank]  # noqa: E731
        _close(out["reducescatter scaled"], mine(_reduce_ref(xs, SUM, 0.5, 3.0)), "float32", "rs scaled")
        _close(out["reducescatter default"], mine(_reduce_ref(xs, AVG)), "float32", "rs default op is Average")
        _close(out["reducescatter fn"], mine(_reduce_ref(xs, SUM)), "float32", "rs in tf.function")
        _close(out["grouped reducescatter"][0], mine(_reduce_ref(xs, SUM)), "float32", "grouped rs 0")
        _close(out["grouped reducescatter"][1], mine(_reduce_ref(xs64, SUM)), "float64", "grouped rs 1")
        (cls, msg), = out["reducescatter errors"]
        assert cls == "UnsupportedOperationError" and "scalar" in msg


def test_fp16_compression_travels_as_float16(values):
    cs = [_x(r, "float32", (6,), 11) * 100 for r in range(2)]
    halves = [c.astype(np.float16) for c in cs]
    xs = [_x(r, "float32", (9, 2), 10).astype(np.float64) for r in range(2)]
    for rank, out in enumerate(values):
        assert out["wire"] == [("allreduce", ["float32"], "fp16"), ("allreduce", ["float32"], None),
                               ("allreduce", ["float32", "int32"], "fp16"), ("reducescatter", ["float16"]),
                               ("allreduce", ["float32"], "fp16")], out["wire"]
        assert out["fp16"].dtype == np.float32 and out["fp16 fn"].dtype == np.float32
        # the mean of the float16 values, within float16's precision of the exact mean
        np.testing.assert_allclose(out["fp16"], (halves[0].astype(np.float32) + halves[1]) / 2, rtol=1e-3)
        np.testing.assert_allclose(out["fp16"], (cs[0] + cs[1]) / 2, rtol=2e-3, atol=0.1)
        _close(out["fp16 none"], _reduce_ref(cs, AVG), "float32", "no compression")
        np.testing.assert_allclose(out["fp16 fn"], cs[0] + cs[1], rtol=2e-3, atol=0.1)
        np.testing.assert_allclose(out["fp16 grouped"][0], cs[0] + cs[1], rtol=2e-3, atol=0.1)
        _close(out["fp16 grouped"][1], _reduce_ref([_x(r, "int32", (3,), 11) for r in range(2)], SUM), "int32",
               "fp16 leaves integers alone")
        assert out["fp16 reducescatter"].dtype == np.float64
        np.testing.assert_allclose(out["fp16 reducescatter"], np.array_split(xs[0] + xs[1], 2)[rank], atol=2e-3)


def test_objects_and_variables(values):
    for rank, out in enumerate(values):
        assert out["broadcast_object"] == {"from": 1, "list": [1, 1, 1]}
        assert out["broadcast_object_fn"] == ("tuple", 0)
        assert out["allgather_object"] == [{"rank": 0, "text": ""}, {"rank": 1, "text": "x" * 1000}]
        assert out["object in fn"][0] == "UnsupportedOperationError" and "runs eagerly" in out["object in fn"][1]
        assert out["broadcast_variables eager"] is None
        _close(out["broadcast_variables"][0], _x(1, "float32", (2, 2), 12), "float32", "broadcast_variables 0")
        _close(out["broadcast_variables"][1], _x(1, "int64", (3,), 12), "int64", "broadcast_variables 1")
        _close(out["broadcast_variables fn"][0], _x(0, "float64", (3,), 13), "float64", "in tf.function 0")
        _close(out["broadcast_variables fn"][1], _x(0, "float32", (1,), 13), "float32", "in tf.function 1")
        _close(out["keras variables"][0], _x(1, "float32", (2, 3), 16), "float32", "Keras 3 variable 0")
        _close(out["keras variables"][1], _x(1, "int32", (2,), 16), "int32", "Keras 3 variable 1")


def test_twenty_allreduces_in_one_tf_function(values):
    for key, mult in (("twenty", 1), ("twenty again", 2)):
        for i in range(20):
            dtype = "float32" if i % 2 == 0 else "int32"
            ins = [(_x(r, dtype, (8,), 14) * mult)[: i % 7 + 1] + np.array(i, dtype) for r in range(2)]
            want = _reduce_ref(ins, OPS[i % 5])
            for out in values:
                _close(out[key][i], want, dtype, f"{key} #{i}")


def test_every_collective_in_one_tf_function_and_barrier_join(values):
    xs = [_x(r, "float32", (3,), 15) for r in range(2)]
    rs = [_x(r, "float32", (r + 1, 2), 15) for r in range(2)]
    for rank, out in enumerate(values):
        for run in out["mixed"]:
            s, g, b, rsc, ga, gb, gg0, gg1, last = run
            _close(s, xs[0] + xs[1], "float32", "allreduce")
            _close(g, np.concatenate(rs), "float32", "allgather")
            _close(b, xs[1] * 2, "float32", "broadcast")
            _close(rsc, np.array_split(_reduce_ref([np.concatenate([x, x, x[:1]]) for x in xs], SUM), 2)[rank],
                   "float32", "reducescatter")
            _close(ga, np.maximum(xs[0], xs[1]), "float32", "grouped max")
            _close(gb, np.maximum(xs[0], xs[1]).astype(np.float64), "float64", "grouped max float64")
            _close(gg0, np.concatenate(rs), "float32", "grouped allgather")
            _close(gg1, np.concatenate([r[:1] for r in rs]), "float32", "grouped allgather 1")
            assert int(last) in (0, 1)
        assert out["join"] == 0  # rank 0 joined 0.8 s after rank 1
    # a barrier inside a tf.function runs: rank 1 waits there for rank 0, which came 1.5 s later
    assert values[1]["barrier wait"] > 0.7, values[1]["barrier wait"]


# ------------------------------------------------------------------------------------------- gradients


def _grad_worker(rank, size):
    tf, hvd = _setup()
    out = {}
    x = tf.Variable(_x(rank, "float32", (3, 4), 20))
    g = tf.constant(_x(rank, "float32", (3, 4), 21))
    cases = [(SUM, 1.0, 1.0), (AVG, 1.0, 1.0), (SUM, 0.5, 3.0), (AVG, 2.0, 0.25)]
    for op, pre, post in cases:
        with tf.GradientTape() as tape:
            y = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
        out[("allreduce", op, pre, post)] = tape.gradient(y, x, output_gradients=g).numpy()

    @tf.function
    def allreduce_grad(t, gy):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = hvd.allreduce(t, op=SUM, postscale_factor=2.0)
        return tape.gradient(y, t, output_gradients=gy)
    out["allreduce fn"] = allreduce_grad(tf.constant(x.numpy()), g).numpy()
    # grouped
    xs = [tf.Variable(_x(rank, "float32", (3,), 22)), tf.Variable(_x(rank, "float64", (2, 2), 22))]
    gs = [tf.constant(_x(rank, "float32", (3,), 23)), tf.constant(_x(rank, "float64", (2, 2), 23))]
    with tf.GradientTape() as tape:
        ys = hvd.grouped_allreduce(xs, op=AVG)
    out["grouped"] = [t.numpy() for t in tape.gradient(ys, xs, output_gradients=gs)]
    # allgather: rows differ between ranks; the upstream gradient differs too
    xa = tf.Variable(_x(rank, "float64", (rank + 2, 3), 24))
    ga = tf.constant(_x(rank, "float64", (5, 3), 25))
    with tf.GradientTape() as tape:
        ya = hvd.allgather(xa)
    out["allgather"] = tape.gradient(ya, xa, output_gradients=ga).numpy()

    @tf.function
    def allgather_grad(t, gy):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = hvd.allgather(t)
        return tape.gradient(y, t, output_gradients=gy)
    out["allgather fn"] = allgather_grad(tf.constant(xa.numpy()), ga).numpy()
    # broadcast from rank 1
    xb = tf.Variable(_x(rank, "float32", (4,), 26))
    gb = tf.constant(_x(rank, "float32", (4,), 27))
    with tf.GradientTape() as tape:
        yb = hvd.broadcast(xb, 1)
    out["broadcast"] = tape.gradient(yb, xb, output_gradients=gb).numpy()
    # reducescatter: 9 rows, rank 0 gets 5, rank 1 gets 4
    xr = tf.Variable(_x(rank, "float32", (9, 2), 28))
    gr = tf.constant(_x(rank, "float32", (5 - rank, 2), 29))
    for op, pre in ((SUM, 1.0), (AVG, 1.0), (SUM, 2.0)):
        with tf.GradientTape() as tape:
            yr = hvd.reducescatter(xr, op=op, prescale_factor=pre)
        out[("reducescatter", op, pre)] = tape.gradient(yr, xr, output_gradients=gr).numpy()
    # a linear model's gradients, averaged as a data-parallel step does
    w = tf.Variable(np.array([0.5, -1.0, 2.0], np.float32))
    data = _x(rank, "float32", (4, 3), 30)
    target = _x(rank, "float32", (4,), 31)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((tf.linalg.matvec(tf.constant(data), w) - target) ** 2)
    out["linear"] = hvd.grouped_allreduce([tape.gradient(loss, w)])[0].numpy()
    return out


@pytest.fixture(scope="module")
def grads():
    return run_workers(_grad_worker, 2, timeout=180)


def test_allreduce_gradient_is_the_same_allreduce(grads):
    gs = [_x(r, "float32", (3, 4), 21) for r in range(2)]
    for out in grads:
        for op, pre, post in [(SUM, 1.0, 1.0), (AVG, 1.0, 1.0), (SUM, 0.5, 3.0), (AVG, 2.0, 0.25)]:
            want = post * pre * (gs[0] + gs[1]) / (2 if op == AVG else 1)
            _close(out[("allreduce", op, pre, post)], want.astype(np.float32), "float32", f"{op} {pre} {post}")
        _close(out["allreduce fn"], (2 * (gs[0] + gs[1])).astype(np.float32), "float32", "in tf.function")
        g32 = [_x(r, "float32", (3,), 23) for r in range(2)]
        g64 = [_x(r, "float64", (2, 2), 23) for r in range(2)]
        _close(out["grouped"][0], (g32[0] + g32[1]) / np.float32(2), "float32", "grouped float32")
        _close(out["grouped"][1], (g64[0] + g64[1]) / 2, "float64", "grouped float64")


def test_allgather_gradient_is_this_ranks_rows_of_the_averaged_gradient(grads):
    mean = (_x(0, "float64", (5, 3), 25) + _x(1, "float64", (5, 3), 25)) / 2
    for rank, out in enumerate(grads):
        want = mean[:2] if rank == 0 else mean[2:]
        _close(out["allgather"], want, "float64", "allgather gradient")
        _close(out["allgather fn"], want, "float64", "allgather gradient in tf.function")


def test_broadcast_gradient_goes_to_the_root(grads):
    mean = (_x(0, "float32", (4,), 27) + _x(1, "float32", (4,), 27)) / np.float32(2)
    _close(grads[1]["broadcast"], mean, "float32", "root")
    _close(grads[0]["broadcast"], np.zeros(4, np.float32), "float32", "not the root")


def test_reducescatter_gradient_is_an_allgather(grads):
    gathered = np.concatenate([_x(0, "float32", (5, 2), 29), _x(1, "float32", (4, 2), 29)])
    for out in grads:
        _close(out[("reducescatter", SUM, 1.0)], gathered * 2, "float32", "Sum: times size()")
        _close(out[("reducescatter", AVG, 1.0)], gathered, "float32", "Average")
        _close(out[("reducescatter", SUM, 2.0)], gathered * 4, "float32", "Sum, prescale 2")


def test_data_parallel_gradient_of_a_linear_model(grads):
    w = np.array([0.5, -1.0, 2.0], np.float64)
    per_rank = []
    for r in range(2):
        data, target = _x(r, "float32", (4, 3), 30).astype(np.float64), _x(r, "float32", (4,), 31)
        per_rank.append(2 / 4 * data.T @ (data @ w - target))
    for out in grads:
        np.testing.assert_allclose(out["linear"], (per_rank[0] + per_rank[1]) / 2, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------- 3 workers


def _three_worker(rank, size):
    import time
    tf, hvd = _setup()
    out = {"who": (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())}
    for dtype, op in (("float32", SUM), ("int32", AVG), ("float64", AVG)):
        out[("reducescatter", dtype, op)] = hvd.reducescatter(tf.constant(_x(rank, dtype, (10, 2), 40)), op=op).numpy()
    out["allgather"] = hvd.allgather(tf.constant(_x(rank, "int32", (rank + 1, 2), 41))).numpy()
    out["int average"] = hvd.allreduce(tf.constant(_x(rank, "int64", (12,), 42))).numpy()
    # all-to-all: uneven splits (zeros too) through the direct API, tensors eagerly and in a graph, hvd with
    # its gradient; an even split without splits=
    import tf_commstrategy as tfcs
    splits = _a2a_splits()[rank]
    rows = _x(rank, "float32", (sum(splits), 2), 43)
    got, got_splits = tfcs.alltoall(rows, splits)
    out["alltoall np"] = (got, list(got_splits))
    got, got_splits = tf.function(lambda t, s: tfcs.alltoall(t, s))(tf.constant(rows), tf.constant(splits))
    out["alltoall fn"] = (got.numpy(), got_splits.numpy().tolist())
    out["alltoall even"] = hvd.alltoall(tf.constant(_x(rank, "int64", (6,), 44))).numpy()
    v = tf.Variable(rows)
    with tf.GradientTape() as tape:
        got, got_splits = hvd.alltoall(v, splits=splits)
        loss = tf.reduce_sum(got * tf.cast(tf.range(1, tf.shape(got)[0] + 1)[:, None], tf.float32))
    out["hvd alltoall"] = (got.numpy(), got_splits.numpy().tolist(), tape.gradient(loss, v).numpy())
    out["alltoall bad splits"] = _error(lambda: hvd.alltoall(tf.ones([4]), splits=[1, 1]))
    hvd.barrier()
    time.sleep({0: 0.3, 1: 1.2, 2: 0.0}[rank])
    out["join"] = int(hvd.join())
    hvd.barrier()
    time.sleep({0: 0.0, 1: 0.0, 2: 1.2}[rank])
    out["join fn"] = int(tf.function(lambda: hvd.join())())
    # ranks calling different collectives: rank 0 all-reduces while the others all-gather
    t = tf.ones([4])
    out["mismatch"] = _error(lambda: hvd.allreduce(t) if rank == 0 else hvd.allgather(t))
    return out


@pytest.fixture(scope="module")
def three_workers():
    return run_workers(_three_worker, 3, timeout=180)


def _a2a_splits():
    return [[2, 0, 3], [1, 1, 1], [0, 4, 0]]  # row o: the rows rank o sends each rank


def test_alltoall_matches_numpy_and_its_gradient_goes_back(three_workers):
    splits = _a2a_splits()
    sent = [_x(o, "float32", (sum(splits[o]), 2), 43) for o in range(3)]
    pieces = [np.split(sent[o], np.cumsum(splits[o])[:-1]) for o in range(3)]
    evens = [_x(o, "int64", (6,), 44) for o in range(3)]
    for rank, out in enumerate(three_workers):
        want = np.concatenate([pieces[o][rank] for o in range(3)])
        received = [splits[o][rank] for o in range(3)]
        for key in ("alltoall np", "alltoall fn", "hvd alltoall"):
            np.testing.assert_array_equal(out[key][0], want, err_msg=key)
            assert out[key][1] == received, (key, out[key][1])
        np.testing.assert_array_equal(out["alltoall even"], np.concatenate([evens[o][2 * rank:2 * rank + 2]
                                                                            for o in range(3)]))
        # d loss / d row = its position (1-based) in the receiving rank's output, sent back to its origin
        grad = out["hvd alltoall"][2]
        for d in range(3):
            start = sum(splits[o][d] for o in range(rank))
            lo = sum(splits[rank][:d])
            for i in range(splits[rank][d]):
                np.testing.assert_array_equal(grad[lo + i], np.full(2, start + i + 1, np.float32))
        cls, msg = out["alltoall bad splits"]
        assert cls == "UnsupportedOperationError" and "must be 3 counts" in msg, (cls, msg)


def test_three_workers_uneven_splits_join_and_a_mismatch(three_workers):
    res = three_workers
    for dtype, op in (("float32", SUM), ("int32", AVG), ("float64", AVG)):
        full = _reduce_ref([_x(r, dtype, (10, 2), 40) for r in range(3)], op)
        for rank, out in enumerate(res):
            _close(out[("reducescatter", dtype, op)], np.array_split(full, 3)[rank], dtype, f"rs {dtype} {op}")
            assert out[("reducescatter", dtype, op)].shape[0] == (4, 3, 3)[rank]
    gathered = np.concatenate([_x(r, "int32", (r + 1, 2), 41) for r in range(3)])
    ints = [_x(r, "int64", (12,), 42) for r in range(3)]
    total = sum(i for i in ints)
    assert ((total % 3 != 0) & (total < 0)).any()  # where truncation and a floor differ
    for rank, out in enumerate(res):
        assert out["who"] == (rank, 3, 0, 1)
        _close(out["allgather"], gathered, "int32", "allgather")
        _close(out["int average"], _reduce_ref(ints, AVG), "int64", "integer average")
        np.testing.assert_array_equal(out["int average"], np.trunc(total / 3))
        assert out["join"] == 1 and out["join fn"] == 2
        cls, msg = out["mismatch"]
        assert cls == "CollectiveMismatchError", (rank, cls, msg)
