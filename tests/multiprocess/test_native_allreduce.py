"""The compiled all-reduce (tf/native/shm_allreduce.cc) under CommStrategy, on real workers of one host:
results against numpy, the same bits on every rank, when it is used and when not (and the WARNING on
every rank when it falls back), a traced graph that holds the segment's name and no address, and its
failures (mismatch, a rank that never comes, a rank killed, calls after shutdown, TFCS_NATIVE=1 without a
compiler). Assertions in the parent."""

import os
import shutil
import time

import numpy as np
import pytest

from tests.helpers import run_workers

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler: the compiled all-reduce cannot be built here")


def _tf():
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import tf_commstrategy as tfcs
    return tf, tfcs


def _sum_step(tf, s):
    """A tf.function that all-reduces (SUM) one tensor through the strategy ``s``."""
    @tf.function
    def step(x):
        return s.run(lambda v: tf.distribute.get_replica_context().all_reduce("sum", v), args=(x,))
    return step


def _inputs(rank, dtype):
    rng = np.random.default_rng(100 + rank)
    shapes = [(3, 5), (), (0,), (1_300_000,), (7, 11, 13)]  # 1.3 M float32: two slots' worth of pieces
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _reduce(rank, size, dtype, op):
    tf, tfcs = _tf()
    s = tfcs.CommStrategy()
    native = s.extended._native
    xs = [tf.constant(a) for a in _inputs(rank, dtype)]

    @tf.function
    def step(xs):
        return s.run(lambda *v: tf.distribute.get_replica_context().all_reduce(op, list(v)), args=tuple(xs))

    @tf.function
    def doubled(xs):  # inputs made inside the graph (intermediates, not tensors the caller holds)
        return s.run(lambda *v: tf.distribute.get_replica_context().all_reduce(op, [2 * t for t in v]),
                     args=tuple(xs))
    calls0 = native.calls() if native is not None else None
    out = [t.numpy() for t in step(xs)]
    out_again = [t.numpy() for t in step(xs)]  # a second call: the next generations of the same slots
    out_doubled = [t.numpy() for t in doubled(xs)]
    eager = s.extended.reduce_to(op.upper(), tf.constant(_inputs(rank, dtype)[0]), "/device:CPU:0").numpy()
    calls = (native.calls() - calls0) if native is not None else None
    return native is not None, calls, out, out_again, out_doubled, eager


@pytest.mark.parametrize("size,dtype,op", [(2, "float32", "sum"), (2, "float64", "mean"), (3, "float32", "mean"),
                                           (3, "float64", "sum")])
def test_results_match_numpy_and_are_the_same_bits_on_every_rank(size, dtype, op):
    res = run_workers(_reduce, size, dtype, op, timeout=240)
    per_rank = [_inputs(r, np.dtype(dtype)) for r in range(size)]
    for used, calls, out, again, doubled, eager in res:
        assert used, "every rank on one host with a compiler: the compiled op must be used"
        assert calls == 4  # three steps and one eager reduce_to, each one call of the op
        for i, got in enumerate(out):
            want = sum(p[i].astype(np.float64) for p in per_rank)
            if op == "mean":
                want = want / size
            assert got.shape == per_rank[0][i].shape and got.dtype == np.dtype(dtype)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"tensor {i}")
            assert got.tobytes() == res[0][2][i].tobytes()  # identical on every rank
            assert got.tobytes() == again[i].tobytes()  # the caller's inputs were not overwritten
            np.testing.assert_allclose(doubled[i], 2 * want, rtol=1e-5, atol=1e-5, err_msg=f"doubled tensor {i}")
        want0 = sum(p[0].astype(np.float64) for p in per_rank)
        np.testing.assert_allclose(eager, want0 / size if op == "mean" else want0, rtol=1e-5, atol=1e-5)


def _kept_records():
    """In a worker: (level name, message) of every record of the ``tf_commstrategy`` logger from now on."""
    import logging
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))
    logging.getLogger("tf_commstrategy").addHandler(Keep())
    return records


def _which_path(rank, size):
    tf, tfcs = _tf()
    records = _kept_records()
    s = tfcs.CommStrategy()
    r = s.run(lambda v: tf.distribute.get_replica_context().all_reduce("sum", v), args=(tf.constant([1.0 + rank]),))
    warned = [m for level, m in records if level == "WARNING" and "compiled all-reduce" in m]
    return s.extended._native is not None, float(r.numpy()[0]), warned


@pytest.mark.parametrize("env", [{"TFCS_NATIVE": "0"}, {"TFCS_TRANSPORT": "unix"}], ids=["off", "unix-asked"])
def test_turned_off_or_another_transport_keeps_the_python_path(env):
    # a choice, not a fallback: no warning
    assert run_workers(_which_path, 2, env=env, timeout=120) == [(False, 3.0, [])] * 2


def test_no_compiler_falls_back_unless_required(tmp_path):
    no_cc = {"TFCS_NATIVE_CACHE": str(tmp_path), "PATH": "/nonexistent", "CXX": ""}
    for used, value, warned in run_workers(_which_path, 2, env=no_cc, timeout=120):
        assert (used, value) == (False, 3.0)
        assert len(warned) == 1 and "no C++ compiler" in warned[0] and "TFCS_NATIVE=0" in warned[0], warned
    res = run_workers(_which_path, 2, env=dict(no_cc, TFCS_NATIVE="1"), timeout=120, expect_failure=True)
    for rank in (0, 1):
        kind, (cls, msg, _) = res[rank]
        assert kind == "error" and cls == "ConfigurationError", res[rank]
        assert "TFCS_NATIVE=1" in msg and "no C++ compiler" in msg, msg


def test_a_failing_build_is_a_warning_on_every_rank_with_the_reason_and_the_fix(tmp_path):
    cache = tmp_path / "empty-cache"
    res = run_workers(_which_path, 2, env={"TFCS_NATIVE_CACHE": str(cache), "CXX": "/bin/false"}, timeout=120)
    for rank, (used, value, warned) in enumerate(res):
        assert (used, value) == (False, 3.0)
        assert len(warned) == 1, (rank, warned)
        text = warned[0]
        assert f"rank {rank}:" in text and "the build failed" in text and "/bin/false" in text, text  # the reason
        assert "install a C++ compiler" in text and "TFCS_NATIVE=0" in text, text  # the fix, and the silencer
    assert not [n for n in os.listdir(cache) if n.endswith(".so")]  # nothing half-built was cached


def _graph_attrs(rank, size):
    tf, tfcs = _tf()
    s = tfcs.CommStrategy()
    native = s.extended._native
    step = _sum_step(tf, s)
    x = tf.ones([4])
    out = step(x).numpy().tolist()
    graph_def = step.get_concrete_function(x).graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    found = []
    for node in nodes:
        if node.op == "TfcsShmAllReduce":
            found.append((sorted(node.attr), node.attr["segment"].s.decode(), node.attr["N"].i,
                          node.attr["spin_us"].i))
    return out, found, native.name


def test_a_traced_graph_names_the_segment_and_holds_no_address_or_pid():
    for out, found, name in run_workers(_graph_attrs, 2, timeout=120):
        assert out == [2.0] * 4
        assert len(found) == 1, found
        keys, segment, n, spin_us = found[0]
        # the op's attributes are its settings and the segment's name, nothing that names memory or processes
        assert keys == ["N", "T", "diverge_s", "mean", "segment", "spin_us", "timeout"], keys
        assert segment == name and name.startswith("tfcs-shm-"), (segment, name)
        assert n == 1 and spin_us in (200, 20000), (n, spin_us)  # one tensor; the op's spin (native_path)


def _failing(rank, size, how):
    tf, tfcs = _tf()
    s = tfcs.CommStrategy(timeout=4 if how == "absent" else 30)
    n = 4 + (rank if how == "mismatch" else 0)
    step = _sum_step(tf, s)
    step(tf.ones([4]))  # a good call first: both ranks are in step
    if how.startswith("word-") and rank == (1 if how == "word-op" else 0):
        # the peer's side of a divergence, as its shared-memory state word shows it: "word-op", rank 1's
        # Python-path wait found it (rank 0 waits in the op); "word-python", rank 0's op found it (rank 1
        # waits in a Python-path collective). No abort message is sent: the word alone must stop the wait.
        from tf_commstrategy.tf import native_path
        native = native_path.NativeAllReduce.for_group(s.process_group)
        time.sleep(1)
        native._words[native._state] = 6  # the op's kDiverged (native_path.STATE_DIVERGED)
        time.sleep(8)  # the other rank raises meanwhile
        return "wrote"
    if rank == 1 and how == "absent":
        time.sleep(8)  # never calls again (and does not leave before rank 0's deadline)
        return "stayed away"
    if rank == 1 and how == "killed":
        os.kill(os.getpid(), 9)
    t0 = time.monotonic()
    try:
        with tfcs.unwrap_errors():
            if rank == 1 and how in ("diverged", "word-python"):  # a Python-path collective, not the strategy's
                tfcs.allreduce(np.ones(3))
            else:
                step(tf.ones([n]))
        return "no error", time.monotonic() - t0
    except tfcs.TfcsError as e:
        after = None
        try:
            tfcs.allreduce(np.ones(2))  # the group is unusable after the failure
        except tfcs.TfcsError as e2:
            after = type(e2).__name__
        return type(e).__name__, time.monotonic() - t0, str(e), after


def test_different_tensors_raise_a_mismatch_on_every_rank_at_once():
    res = run_workers(_failing, 2, "mismatch", timeout=120)
    for cls, took, msg, after in res:
        assert cls == "CollectiveMismatchError", msg
        assert took < 10, took  # long before the 30 s deadline
        assert after is not None


def test_ranks_in_different_collectives_raise_a_mismatch_on_every_rank_long_before_the_deadline():
    # rank 0 in the compiled all-reduce, rank 1 in an all-reduce of the Python path: neither can finish;
    # after DIVERGE_S (5 s) of both waiting, each rank names the other's collective
    res = run_workers(_failing, 2, "diverged", timeout=120)
    for rank, (cls, took, msg, after) in enumerate(res):
        assert cls == "CollectiveMismatchError", msg
        assert 4.5 < took < 15, took  # the 30 s deadline is far off
        assert "different collectives" in msg and f"rank {1 - rank}" in msg
        assert after is not None  # the group is unusable afterwards
    assert "compiled all-reduce" in res[1][2]  # rank 1 names where rank 0 is


@pytest.mark.parametrize("waiting", ["op", "python"])
def test_a_peer_that_found_the_divergence_first_stops_the_wait_with_the_same_mismatch(waiting):
    # one side found the divergence and says so in its state word; the rank still waiting (in the op, or in
    # a Python-path collective) raises the same CollectiveMismatchError from that word at once, whether or
    # not the first side's abort message has arrived (here it never comes)
    res = run_workers(_failing, 2, f"word-{waiting}", timeout=120)
    waiter = 0 if waiting == "op" else 1
    assert res[1 - waiter] == "wrote"
    cls, took, msg, after = res[waiter]
    assert cls == "CollectiveMismatchError", msg
    assert took < 4, took  # 1 s after the call, far from the 5 s divergence limit and the 30 s deadline
    assert "different collectives" in msg and f"rank {1 - waiter}" in msg, msg


def test_a_rank_that_never_calls_is_a_timeout_at_the_deadline():
    res = run_workers(_failing, 2, "absent", timeout=120)
    cls, took, msg, after = res[0]
    assert cls == "CollectiveTimeoutError", msg
    assert 3.5 < took < 15, took
    assert res[1] == "stayed away"


def test_a_killed_rank_is_a_peer_lost_error_within_a_second_or_so():
    res = run_workers(_failing, 2, "killed", timeout=120, expect_failure=True)
    kind, (cls, took, msg, after) = res[0]
    assert kind == "ok" and cls == "PeerLostError", res[0]
    assert took < 5, took
    assert "rank 1" in msg


def _after_shutdown(rank, size):
    tf, tfcs = _tf()
    from tf_commstrategy.core import shared_memory
    s = tfcs.CommStrategy()
    step = _sum_step(tf, s)
    first = float(step(tf.ones([3])).numpy()[0])
    left = [n for n in os.listdir(shared_memory.SHM_DIR) if "-native-" in n and n.startswith("tfcs-shm-")]
    tfcs.shutdown()
    try:
        with tfcs.unwrap_errors():
            step(tf.ones([3]))  # the graph names the old segment, shut down now
        return first, left, "no error"
    except tfcs.TfcsError as e:
        return first, left, type(e).__name__


def test_a_call_through_an_old_graph_after_shutdown_fails_cleanly_and_no_segment_stays():
    res = run_workers(_after_shutdown, 2, timeout=120)
    for first, left, after in res:
        assert first == 2.0
        assert left == []  # unlinked once every rank mapped it
        assert after == "NotInitializedError"


def test_typed_errors_from_the_ops_tags():
    import tensorflow as tf
    from tf_commstrategy import errors
    from tf_commstrategy.tf.native_path import typed_error

    def op_error(cls, text):
        return cls(None, None, text)
    e = typed_error(op_error(tf.errors.UnavailableError, "[tfcs-native:peer_lost:3] rank 1: rank 3 (pid 9) died"))
    assert isinstance(e, errors.PeerLostError) and e.peer_rank == 3 and e.rank == 1 and "died" in str(e)
    # with the group's workers, the lost peer's host is named (as on the Python path)
    from tf_commstrategy.rendezvous.rendezvous import WorkerInfo
    workers = [WorkerInfo(rank=r, hostname=f"node{r}", boot_id="b", pid=9) for r in range(4)]
    e = typed_error(op_error(tf.errors.UnavailableError, "[tfcs-native:peer_lost:3] rank 1: rank 3 (pid 9) died"),
                    workers)
    assert isinstance(e, errors.PeerLostError) and e.peer_address == "host node3"
    assert str(e).startswith("rank 3 (host node3, pid 9) died"), str(e)
    e = typed_error(op_error(tf.errors.AbortedError, "[tfcs-native:aborted:2] rank 0: rank 2 stopped"))
    assert isinstance(e, errors.CollectiveAbortedError) and e.origin_rank == 2
    assert isinstance(typed_error(op_error(tf.errors.DeadlineExceededError, "[tfcs-native:timeout] rank 0: x")),
                      errors.CollectiveTimeoutError)
    assert isinstance(typed_error(op_error(tf.errors.FailedPreconditionError, "[tfcs-native:failed] rank 0: x")),
                      errors.CollectiveError)
    e = typed_error(op_error(tf.errors.FailedPreconditionError, "[tfcs-native:diverged:1] rank 0: rank 1 has "
                                                                "been in another collective"))
    assert isinstance(e, errors.CollectiveMismatchError) and e.remote_rank == 1 and e.rank == 0
    assert typed_error(op_error(tf.errors.InternalError, "something else")) is None


def _busy(rank, size):
    tf, tfcs = _tf()
    s = tfcs.CommStrategy()
    native = s.extended._native
    step = _sum_step(tf, s)
    step(tf.ones([4]))
    before = native.busy_seconds(), native.wait_seconds()
    if rank == 1:
        time.sleep(1.0)  # rank 0 waits for this rank inside the op: its time there counts, as a wait
    step(tf.ones([4]))
    return native.busy_seconds() - before[0], native.wait_seconds() - before[1]


def test_the_time_inside_the_op_and_the_waits_are_counted():
    (waited, waiting), (quick, quick_wait) = run_workers(_busy, 2, timeout=120)
    assert 0.8 < waited < 5.0, waited
    assert 0.8 < waiting <= waited, (waiting, waited)  # the second was spent waiting for rank 1
    assert waited - waiting < 0.5, (waited, waiting)  # its own work on 4 floats is quick
    assert quick < 0.5 and 0 <= quick_wait <= quick, (quick, quick_wait)


def _sleeps_while_waiting(rank, size):
    """Rank 1 calls 12 ms after rank 0, 20 times, then 1 s after it once: for each, how often rank 0's
    process went to sleep over its calls (voluntary context switches: a yield that finds other work is not
    one) and its wall seconds."""
    import resource
    tf, tfcs = _tf()
    s = tfcs.CommStrategy()
    step = _sum_step(tf, s)
    x = tf.ones([4])
    step(x)
    native = s.extended._native
    out = []
    for late_s, reps in ((0.012, 20), (1.0, 1)):
        sleeps = 0
        waited = native.wait_seconds()
        for _ in range(reps):
            tfcs.barrier()
            if rank == 1:
                time.sleep(late_s)
            c0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            step(x)
            sleeps += resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - c0
        out.append((sleeps, native.wait_seconds() - waited))
    return out


def test_a_short_wait_keeps_the_core_and_a_long_one_gives_it_up():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the ranks share it, so the op spins only 0.2 ms")
    (sleeps, waited), (long_sleeps, long_waited) = run_workers(_sleeps_while_waiting, 2, timeout=120)[0]
    assert waited > 0 and long_waited > 0, (waited, long_waited)  # the op counted rank 0's waits for rank 1
    # a wait of 12 ms yields in a loop, never sleeping: the few sleeps per call are TensorFlow's own hand-offs
    # between its threads (a 1 ms spin, then 50 us sleeps, made over 60 per call)
    assert sleeps < 20 * 15, (sleeps, waited)
    assert long_sleeps > 100, (long_sleeps, long_waited)  # past 20 ms it sleeps


def _mixed(rank, size):
    """float32 and float64 calls in one function and in two functions, and a call with only empty tensors:
    every rank's generations stay in step (a later call still agrees)."""
    tf, tfcs = _tf()
    s = tfcs.CommStrategy()
    ar = lambda *v: tf.distribute.get_replica_context().all_reduce("sum", list(v))  # noqa: E731

    @tf.function
    def both(a, b):
        return s.run(ar, args=(a,)), s.run(ar, args=(b,))

    @tf.function
    def empty(e1, e2):
        return s.run(ar, args=(e1, e2))
    a = tf.constant(np.full(5, rank + 1.0, np.float32))
    b = tf.constant(np.full(3, rank + 1.0, np.float64))
    out = []
    for _ in range(3):
        x, y = both(a, b)
        e = empty(tf.zeros([0], tf.float32), tf.zeros([2, 0], tf.float32))
        out.append((x[0].numpy().tolist(), y[0].numpy().tolist(), [t.shape.as_list() for t in e]))
    return s.extended._native.calls(), out


def test_float_and_double_calls_and_empty_calls_share_the_generations():
    for calls, out in run_workers(_mixed, 2, timeout=120):
        assert calls == 9
        for x, y, shapes in out:
            assert x == [3.0] * 5 and y == [3.0] * 3 and shapes == [[0], [2, 0]]


def _huge_deadline(rank, size):
    tf, tfcs = _tf()
    s = tfcs.CommStrategy()
    step = _sum_step(tf, s)
    step(tf.ones([2]))
    if rank == 1:
        time.sleep(0.5)  # rank 0 waits past its spin: a deadline centuries away must not read as an expired one
    return step(tf.ones([2])).numpy().tolist()


def test_a_timeout_of_centuries_waits():
    # TFCS_TIMEOUT is finite; 5e9 s (5e18 ns, near the int64 limit and Python's threading.TIMEOUT_MAX)
    assert run_workers(_huge_deadline, 2, env={"TFCS_TIMEOUT": "5e9"}, timeout=120) == [[2.0, 2.0]] * 2


def _old_graph_after_reinit(rank, size):
    tf, tfcs = _tf()
    s = tfcs.CommStrategy()
    step = _sum_step(tf, s)
    step(tf.ones([2]))
    tfcs.shutdown()
    tfcs.init()  # a new job on the same coordinator address
    try:
        with tfcs.unwrap_errors():
            step(tf.ones([2]))  # the old graph: the old, released segment
        old = "no error"
    except tfcs.TfcsError as e:
        old = type(e).__name__
    return old, tfcs.allreduce(np.ones(2)).tolist()  # the new group was not aborted by the old graph's error


def test_an_old_graph_after_a_new_init_fails_without_aborting_the_new_job():
    assert run_workers(_old_graph_after_reinit, 2, timeout=120) == [("NotInitializedError", [2.0, 2.0])] * 2


def _failure_without_unwrap(rank, size):
    tf, tfcs = _tf()
    s = tfcs.CommStrategy(timeout=30)
    step = _sum_step(tf, s)
    try:
        step(tf.ones([4 + rank]))  # different tensors; no unwrap_errors around the call
        first = "no error"
    except tf.errors.OpError as e:
        first = type(e).__name__
    try:
        tfcs.allreduce(np.ones(2))  # the Python path must refuse: the group is unusable
        after = "no error"
    except tfcs.TfcsError as e:
        after = type(e).__name__
    return first, after


def test_a_failed_call_makes_the_group_unusable_even_without_unwrap_errors():
    for first, after in run_workers(_failure_without_unwrap, 2, timeout=120):
        assert first == "FailedPreconditionError" and after == "CollectiveError", (first, after)


def _interleaved(rank, size):
    tf, tfcs = _tf()
    s = tfcs.CommStrategy()
    native = s.extended._native
    backend = s.process_group.backend("grpc")
    step = _sum_step(tf, s)
    big = np.arange(1_500_000, dtype=np.float32) * (rank + 1)  # 6 MB: two pieces of the op, two-round in Python
    calls0, python0 = native.calls(), backend.stats().collectives
    out = []
    for i in range(3):  # the op and every kind of Python-path collective, one after the other
        out.append(step(tf.ones([5]) * (rank + 1)).numpy().tolist())
        out.append(tfcs.allreduce(np.full(7, rank + i, np.float64)).tolist())  # the buffers' one-round path
        out.append(float(step(tf.constant(big)).numpy()[-1]))  # the op's pieces
        out.append(tfcs.broadcast(np.array([rank * 10 + i]), root_rank=1).tolist())  # the ring
        out.append(float(tfcs.allreduce(big)[-1]))  # large: the buffers' two-round path (3 ranks) or the ring
    return out, native.calls() - calls0, backend.stats().collectives - python0


@pytest.mark.parametrize("size", [2, 3])
def test_the_op_and_the_python_path_interleave(size):
    total = sum(range(1, size + 1))
    last = float(np.float32(1_499_999) * np.float32(total))
    for out, op_calls, python_calls in run_workers(_interleaved, size, timeout=180):
        for i in range(3):
            x = out[5 * i:5 * i + 5]
            assert x[0] == [float(total)] * 5
            assert x[1] == [float(sum(r + i for r in range(size)))] * 7
            assert x[2] == last and x[4] == last
            assert x[3] == [10 + i]
        assert op_calls == 6 and python_calls == 9  # each on its own path
