"""The nccl backend's own logic in real multi-process jobs, on the fake GPU of tests/fakegpu.

The fake's NcclCommunicator runs every collective across the processes over the grpc ring,
addressed by raw pointers as NCCL is, so everything tf_commstrategy does around NCCL runs for
real: dtype/op mapping, bfloat16 in uint16, means, uneven all-gathers and reduce-scatters, grouped
calls, signature checks, the communicator's creation, deadlines and aborts. Results are compared
in the parent with numpy. NCCL and CUDA themselves are tested on a GPU (tests/gpu).
"""

import numpy as np
import pytest

from tests.helpers import run_workers, wait_until
from tests.nccl_cases import SHAPE, _pairs, make_input, reference, to_device, to_host


def _setup():
    from tests import fakegpu
    cupy = fakegpu.install()
    import tf_commstrategy as tfcs
    tfcs.init()
    return cupy, tfcs, fakegpu


def w_every_op(rank, size):
    cupy, tfcs, fake = _setup()
    out = {}
    for d, op in _pairs():
        y = tfcs.allreduce(to_device(cupy, make_input(rank, d, op)), op, backend="nccl")
        out[(d, op)] = to_host(y)
    return out, dict(fake.log)


@pytest.mark.parametrize("size,cupy_major", [(2, 13), (3, 13), (1, 14), (2, 14)])
def test_allreduce_every_dtype_and_op_matches_numpy(size, cupy_major):
    # cupy 14 takes the unique id as bytes (13: a tuple of chars); a one-process job has no store
    results = run_workers(w_every_op, size, timeout=180, env={"FAKE_CUPY_MAJOR": str(cupy_major)})
    for d, op in _pairs():
        ref = reference([make_input(r, d, op) for r in range(size)], op, d)
        for rank, (out, log) in enumerate(results):
            got, kind = out[(d, op)]
            assert kind == ("Bfloat16Array" if d == "bfloat16" else "cupy.ndarray"), (d, kind)
            assert got.dtype == ref.dtype and got.shape == SHAPE, (d, op, got.dtype, got.shape)
            if d in ("float16", "bfloat16"):
                np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=2e-2, atol=2e-2,
                                           err_msg=f"{d} {op} rank {rank}")
            elif d in ("float32", "float64"):
                np.testing.assert_allclose(got, ref, rtol=1e-6, err_msg=f"{d} {op} rank {rank}")
            else:
                np.testing.assert_array_equal(got, ref, err_msg=f"{d} {op} rank {rank}")
    for out, log in results:
        assert len({tuple(map(tuple, u)) for u in log["uids"]}) == 1  # one communicator
        assert all(len(set(map(tuple, u))) == 1 for u in log["uids"])  # the same unique id on every rank


def w_movement(rank, size):
    cupy, tfcs, fake = _setup()
    r = {}
    x = np.arange(12, dtype=np.float32).reshape(4, 3) + 100 * rank
    r["bcast"] = to_host(tfcs.broadcast(cupy.asarray(x), 1, backend="nccl"))[0]
    ys = tfcs.grouped_broadcast([cupy.asarray(x), cupy.asarray(np.full(5, rank, np.int64))], 1, backend="nccl")
    r["gbcast"] = [to_host(y)[0] for y in ys]
    uneven = np.full((rank + 1, 2), rank, dtype=np.int32)
    r["gather_uneven"] = to_host(tfcs.allgather(cupy.asarray(uneven), backend="nccl"))[0]
    r["gather_even"] = to_host(tfcs.allgather(cupy.asarray(x), backend="nccl"))[0]
    r["gather_scalar"] = to_host(tfcs.allgather(cupy.asarray(np.float64(rank)), backend="nccl"))[0]
    rs_in = np.arange(14, dtype=np.int64).reshape(7, 2) * (rank + 1)
    r["rs_sum"] = to_host(tfcs.reduce_scatter(cupy.asarray(rs_in), "sum", backend="nccl"))[0]
    r["rs_mean"] = to_host(tfcs.reduce_scatter(cupy.asarray(rs_in), "mean", backend="nccl"))[0]
    even = np.arange(6 * size, dtype=np.float32).reshape(2 * size, 3) + rank
    r["rs_even"] = to_host(tfcs.reduce_scatter(cupy.asarray(even), "sum", backend="nccl"))[0]
    groups0 = fake.log["groups"]
    grads = [cupy.asarray(np.full((3,), rank + 1.0, np.float32)), cupy.asarray(np.full((2, 2), rank, np.int32)),
             cupy.asarray(np.full((4,), rank + 0.5, np.float64))]
    r["grouped"] = [to_host(y)[0] for y in tfcs.grouped_allreduce(grads, "mean", backend="nccl")]
    r["grouped_groups"] = fake.log["groups"] - groups0
    tfcs.barrier(backend="nccl")
    # a GPU array meeting the grpc backend is staged through the host and comes back as a GPU array
    staged = tfcs.allreduce(cupy.asarray(np.full(3, rank, np.float32)), backend="grpc")
    r["staged"] = to_host(staged)
    return r


@pytest.mark.parametrize("size", [2, 3])
def test_broadcast_allgather_reduce_scatter_grouped_barrier(size):
    results = run_workers(w_movement, size, timeout=180)
    x1 = np.arange(12, dtype=np.float32).reshape(4, 3) + 100
    want_uneven = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(size)])
    want_even = np.concatenate([np.arange(12, dtype=np.float32).reshape(4, 3) + 100 * r for r in range(size)])
    rs_total = sum(np.arange(14, dtype=np.int64).reshape(7, 2) * (r + 1) for r in range(size))
    even_total = sum(np.arange(6 * size, dtype=np.float32).reshape(2 * size, 3) + r for r in range(size))
    for rank, r in enumerate(results):
        np.testing.assert_array_equal(r["bcast"], x1)
        np.testing.assert_array_equal(r["gbcast"][0], x1)
        np.testing.assert_array_equal(r["gbcast"][1], np.full(5, 1, np.int64))
        np.testing.assert_array_equal(r["gather_uneven"], want_uneven)
        np.testing.assert_array_equal(r["gather_even"], want_even)
        np.testing.assert_array_equal(r["gather_scalar"], np.arange(size, dtype=np.float64))
        np.testing.assert_array_equal(r["rs_sum"], np.array_split(rs_total, size)[rank])
        np.testing.assert_array_equal(r["rs_mean"], np.array_split(rs_total // size, size)[rank])
        np.testing.assert_allclose(r["rs_even"], np.array_split(even_total, size)[rank])
        np.testing.assert_allclose(r["grouped"][0], np.full(3, sum(q + 1.0 for q in range(size)) / size))
        np.testing.assert_array_equal(r["grouped"][1], np.full((2, 2), sum(range(size)) // size, np.int32))
        np.testing.assert_allclose(r["grouped"][2], np.full(4, sum(q + 0.5 for q in range(size)) / size))
        assert r["grouped_groups"] == 1, "a grouped all-reduce must be one ncclGroupStart/End"
        np.testing.assert_array_equal(r["staged"][0], np.full(3, sum(range(size)), np.float32))
        assert r["staged"][1] == "cupy.ndarray"


def w_compressed(rank, size):
    cupy, tfcs, fake = _setup()
    from tf_commstrategy.process import default_group
    nccl = default_group().backend("nccl")
    x = np.random.default_rng(rank).standard_normal(1000).astype(np.float32) * 3
    r = {}
    for name, arr, compression in (("none", x, "none"), ("fp16", x, "fp16"), ("bf16", x, "bf16"),
                                   ("f64 fp16", x.astype(np.float64), "fp16")):
        before = nccl.stats().collective_bytes
        y = tfcs.allreduce(cupy.asarray(arr), "sum", backend="nccl", compression=compression)
        r[name] = (to_host(y), nccl.stats().collective_bytes - before)
    before = nccl.stats().collective_bytes
    ys = tfcs.grouped_allreduce([cupy.asarray(x), cupy.asarray(np.arange(4, dtype=np.int32))], "mean",
                                backend="nccl", compression="fp16")
    r["grouped"] = ([to_host(y)[0] for y in ys], nccl.stats().collective_bytes - before)
    return r


def test_compressed_allreduces_move_half_the_bytes_and_come_back_in_their_dtype():
    size = 2
    results = run_workers(w_compressed, size, timeout=180)
    xs = [np.random.default_rng(q).standard_normal(1000).astype(np.float32) * 3 for q in range(size)]
    ref = np.sum(np.stack(xs).astype(np.float64), axis=0)
    mags = np.abs(np.stack(xs)).sum(axis=0)
    for r in results:
        (y, kind), moved = r["none"]
        assert moved == 4000 and kind == "cupy.ndarray"
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
        for name, unit in (("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)):
            (yc, kind), moved_c = r[name]
            assert moved_c == 2000 and yc.dtype == np.float32 and kind == "cupy.ndarray", (name, moved_c, yc.dtype)
            err = np.abs(yc - ref)
            assert (err <= (2 * size) * unit * mags).all() and err.max() > 1e-4, (name, float(err.max()))
        (y64, _), moved64 = r["f64 fp16"]
        assert y64.dtype == np.float64 and moved64 == 2000
        grouped, moved_g = r["grouped"]
        assert moved_g == 2000 + 16  # float32 narrowed, int32 as it is
        assert (np.abs(grouped[0] - ref / size) <= 2 * 2.0 ** -11 * mags).all()
        np.testing.assert_array_equal(grouped[1], np.arange(4, dtype=np.int32))


def w_alltoall(rank, size):
    cupy, tfcs, fake = _setup()
    splits = [[1, 0, 2], [0, 0, 3], [2, 2, 0]][rank]
    x = np.arange(sum(splits) * 2, dtype=np.float32).reshape(-1, 2) + 100 * rank
    got, got_splits = tfcs.alltoall(cupy.asarray(x), splits, backend="nccl")
    even, _ = tfcs.alltoall(cupy.asarray(np.full(3, rank, np.int64)), backend="nccl")
    return to_host(got), got_splits, to_host(even)[0]


def test_alltoall_sends_every_block_with_one_group_of_sends_and_receives():
    splits = [[1, 0, 2], [0, 0, 3], [2, 2, 0]]
    results = run_workers(w_alltoall, 3, timeout=180)
    sent = [np.arange(sum(splits[o]) * 2, dtype=np.float32).reshape(-1, 2) + 100 * o for o in range(3)]
    for rank, ((got, kind), got_splits, even) in enumerate(results):
        want = np.concatenate([np.split(sent[o], np.cumsum(splits[o])[:-1])[rank] for o in range(3)])
        assert kind == "cupy.ndarray" and got_splits == [splits[o][rank] for o in range(3)]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(even, np.arange(3, dtype=np.int64))


def w_mismatch(rank, size, shapes):
    cupy, tfcs, fake = _setup()
    tfcs.allreduce(cupy.asarray(np.ones(2, np.float32)), backend="nccl")
    shape = shapes[0] if rank == 0 else shapes[1]
    tfcs.allreduce(cupy.asarray(np.ones(shape, np.float32)), backend="nccl", timeout=20)


@pytest.mark.parametrize("size,shapes", [
    (2, [(4,), (5,)]),     # counts differ: NCCL never completes the call; the verdict ends the wait
    (3, [(4,), (5,)]),     # a rank that reads another's mismatch first must not make the rest see only an abort
    (2, [(2, 2), (4,)]),   # same count, same NCCL call: it completes, with data that must not be returned
], ids=["2-ranks-hang", "3-ranks-hang", "same-count"])
def test_mismatched_calls_raise_on_every_rank_with_both_signatures(size, shapes):
    out = run_workers(w_mismatch, size, shapes, expect_failure=True, timeout=90)
    mine = ["float32" + str(list(s)) for s in shapes]
    for rank in range(size):
        kind, (cls, msg, _tb) = out[rank]
        assert kind == "error" and cls == "CollectiveMismatchError", out[rank]
        assert mine[0] in msg and mine[1] in msg, msg


def w_mixed_check_setting(rank, size):
    import os
    os.environ["TFCS_NCCL_CHECK"] = "1" if rank == 0 else "0"  # read when the backend is built
    cupy, tfcs, fake = _setup()
    tfcs.allreduce(cupy.asarray(np.ones(2, np.float32)), backend="nccl", timeout=20)


def test_ranks_with_different_signature_check_settings_are_refused():
    out = run_workers(w_mixed_check_setting, 2, expect_failure=True, timeout=90)
    for rank in (0, 1):
        kind, (cls, msg, _tb) = out[rank]
        assert kind == "error" and cls == "ConfigurationError", out[rank]
        assert "check=1" in msg and "check=0" in msg and "TFCS_NCCL_CHECK" in msg, msg


def w_interrupted(rank, size):
    import _thread
    import signal
    import threading
    cupy, tfcs, fake = _setup()
    x = cupy.asarray(np.ones(3, np.float32))
    tfcs.allreduce(x, backend="nccl", timeout=30)  # collectives #0 and #1: check and data
    if rank == 0:  # Ctrl-C while the next call waits for the GPU (its data collective, #3, never completes)
        # Python's own SIGINT handler: a process started by one that ignores SIGINT (a pytest-xdist worker)
        # inherits the ignoring, and interrupt_main() then does nothing
        signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Timer(1.0, _thread.interrupt_main).start()
        try:
            tfcs.allreduce(x, backend="nccl", timeout=30)
            first = "no error"
        except KeyboardInterrupt:
            first = "KeyboardInterrupt"
    else:
        try:
            tfcs.allreduce(x, backend="nccl", timeout=30)
            first = "no error"
        except tfcs.TfcsError as e:
            first = type(e).__name__
    try:
        tfcs.allreduce(x, backend="nccl", timeout=30)
        after = "no error"
    except tfcs.TfcsError as e:
        after = f"{type(e).__name__}: {e}"
    return first, after, fake.log["aborted"]


def test_an_interrupted_call_aborts_the_communicator_and_tells_the_peers():
    (first0, after0, aborted0), (first1, after1, aborted1) = run_workers(
        w_interrupted, 2, env={"FAKE_NCCL_HANG_AT": "3"}, timeout=90)
    assert first0 == "KeyboardInterrupt" and aborted0 >= 1
    assert after0.startswith("CollectiveError") and "interrupted (KeyboardInterrupt)" in after0, after0
    assert first1 == "CollectiveAbortedError" and aborted1 >= 1  # within its deadline's 30 s: told at once


def w_hang(rank, size):
    import time
    cupy, tfcs, fake = _setup()
    x = cupy.asarray(np.ones(3, np.float32))
    tfcs.allreduce(x, backend="nccl")
    t0 = time.monotonic()
    try:
        tfcs.allreduce(x, backend="nccl", timeout=2.0)
    except Exception as e:
        took = time.monotonic() - t0
        try:
            tfcs.allreduce(x, backend="nccl")
            after = "no error"
        except Exception as e2:
            after = f"{type(e2).__name__}: {e2}"
        return type(e).__name__, str(e), took, fake.log["aborted"], after
    return "no error"


def test_a_collective_that_never_completes_times_out_and_aborts_the_communicator():
    # collective #0 is the first call's signature check, #1 its data, #2 the second call's check
    results = run_workers(w_hang, 2, env={"FAKE_NCCL_HANG_AT": "2"}, timeout=90)
    for cls, msg, took, aborted, after in results:
        assert cls == "CollectiveTimeoutError", (cls, msg)
        assert "aborted" in msg and 1.9 < took < 10, (msg, took)
        assert aborted >= 1
        assert after.startswith("CollectiveError") and "unusable" in after, after


def w_async_error(rank, size):
    cupy, tfcs, fake = _setup()
    x = cupy.asarray(np.ones(3, np.float32))
    for _ in range(4):
        tfcs.allreduce(x, backend="nccl", timeout=20)


def test_an_asynchronous_nccl_error_becomes_a_typed_error_on_every_rank():
    out = run_workers(w_async_error, 2, env={"FAKE_NCCL_ASYNC_ERROR_AT": "1"}, expect_failure=True, timeout=90)
    for rank in (0, 1):
        kind, (cls, msg, _tb) = out[rank]
        assert kind == "error" and cls in ("CollectiveError", "CollectiveAbortedError"), out[rank]
    assert any("injected asynchronous error" in out[r][1][1] for r in (0, 1))


def w_oom(rank, size):
    cupy, tfcs, fake = _setup()
    x = cupy.asarray(np.ones(3, np.float32))
    tfcs.allreduce(x, backend="nccl", timeout=30)  # the communicator exists
    if rank == 1:  # the next result cannot be allocated here (cupy's OutOfMemoryError is a MemoryError)
        def oom(*a, **k):
            raise MemoryError("Out of memory allocating 12 bytes (injected)")
        cupy.empty = oom
    out = []
    for _ in range(2):
        try:
            tfcs.allreduce(x, backend="nccl", timeout=30)
            out.append("no error")
        except tfcs.TfcsError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_any_error_before_nccl_runs_fails_the_backend_and_tells_the_peers():
    (first0, _), (first1, after1) = run_workers(w_oom, 2, timeout=90)
    assert first1.startswith("CollectiveError") and "MemoryError" in first1 and "injected" in first1, first1
    assert "unusable" in after1, after1  # not paired with the peers' next collective
    # the peer hears of it over the control plane at once, instead of waiting out its 30 s deadline
    assert first0.startswith("CollectiveAbortedError") and "rank 1" in first0, first0


def w_close_after_control_failure(rank, size, fail):
    import time
    cupy, tfcs, fake = _setup()
    tfcs.allreduce(cupy.asarray(np.ones(3, np.float32)), backend="nccl", timeout=30)  # a communicator
    if fail:
        if rank == 0:  # rank 1 never joins this ring all-reduce: rank 0 times out and tells rank 1
            try:
                tfcs.allreduce(np.ones(3), backend="grpc", timeout=2)
            except tfcs.CollectiveTimeoutError:
                pass
            time.sleep(4)
        else:  # rank 1 hears of it while idle (only its control plane knows)
            from tf_commstrategy.process import default_group
            grpc = default_group().backend("grpc")
            wait_until(lambda: grpc.failure() is not None, timeout=30)
    tfcs.shutdown()
    return fake.log["aborted"], fake.log["destroyed"]


@pytest.mark.parametrize("fail", [False, True], ids=["clean", "after-a-control-plane-failure"])
def test_shutdown_destroys_communicators_after_a_clean_run_and_aborts_them_after_a_failure(fail):
    for aborted, destroyed in run_workers(w_close_after_control_failure, 2, fail, timeout=90):
        assert (aborted, destroyed) == ((1, 0) if fail else (0, 1))


def w_absent(rank, size):
    import time
    cupy, tfcs, fake = _setup()
    if rank == 1:
        time.sleep(8)  # joins the job, never the NCCL communicator
        return "idle"
    t0 = time.monotonic()
    try:
        tfcs.allreduce(cupy.asarray(np.ones(3, np.float32)), backend="nccl", timeout=3.0)
    except Exception as e:
        return type(e).__name__, str(e), list(getattr(e, "waiting_for", [])), time.monotonic() - t0
    return "no error"


def test_a_rank_that_never_creates_the_communicator_is_named_in_a_timeout():
    out = run_workers(w_absent, 2, expect_failure=True, timeout=90)
    kind, value = out[0]
    assert kind == "ok", out[0]
    cls, msg, waiting, took = value
    assert cls == "CollectiveTimeoutError" and waiting == [1], (cls, msg, waiting)
    assert 2.9 < took < 10 and "never joined" in msg, (took, msg)


def w_tf_cpu_tensor(rank, size):
    cupy, tfcs, fake = _setup()
    import tensorflow as tf
    try:
        tfcs.allreduce(tf.constant([1.0, 2.0]), backend="nccl")
        explicit = "no error"
    except Exception as e:
        explicit = (type(e).__name__, str(e))
    auto = tfcs.allreduce(tf.constant([1.0, 2.0]), backend="auto").numpy().tolist()
    return explicit, auto


def test_a_cpu_tensor_sent_to_nccl_is_refused_with_the_fix_and_auto_uses_grpc():
    (explicit, auto), = run_workers(w_tf_cpu_tensor, 1, timeout=120)
    assert explicit[0] == "UnsupportedOperationError" and "GPU tensors" in explicit[1], explicit
    assert "backend='grpc'" in explicit[1]
    assert auto == [1.0, 2.0]
