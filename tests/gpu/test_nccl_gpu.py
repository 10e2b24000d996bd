"""The nccl backend on real GPUs with cupy arrays (no TensorFlow): every op x dtype against numpy with
fresh random inputs, the data-movement collectives, grouped calls, stream ordering and the refusals.

Workers run one per GPU (``conftest.gpu_world``); every rank computes every rank's input from the
same seed, so the parent compares each result with a numpy reference of all inputs.
"""

import os
import sys
import time

import numpy as np
import pytest

from tests.gpu.conftest import emulate_host, gpu_world
from tests.helpers import run_workers
from tests.nccl_cases import BF16, _pairs, make_input, reference, to_device, to_host

SEED = int(os.environ.get("TFCS_GPU_SEED", time.time_ns() % (1 << 31)))  # fresh inputs, printed on failure
SHAPES = [(5, 3), (1000, 257)]


def _setup(rank):
    emulate_host(rank)
    if os.environ.get("TFCS_GPU_DRYRUN") == "1":
        from tests import fakegpu
        fakegpu.install()
    import cupy
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    import tf_commstrategy as tfcs
    tfcs.init()
    return cupy, tfcs


def w_every_op(rank, size, seed):
    cupy, tfcs = _setup(rank)
    out = {}
    for shape in SHAPES:
        for d, op in _pairs():
            y = tfcs.allreduce(to_device(cupy, make_input(rank, d, op, seed, shape)), op, backend="nccl")
            out[(shape, d, op)] = to_host(y)
    return out, "tensorflow" in sys.modules


def _check(got, ref, d, what):
    assert got.dtype == ref.dtype and got.shape == ref.shape, (what, got.dtype, got.shape)
    if d in ("float16", "bfloat16"):
        np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=2e-2, atol=2e-2,
                                   err_msg=what)
    elif d in ("float32", "float64"):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=what)
    else:
        np.testing.assert_array_equal(got, ref, err_msg=what)


@pytest.mark.timeout(300)
def test_allreduce_every_dtype_and_op_matches_numpy():
    size = gpu_world()
    results = run_workers(w_every_op, size, SEED, timeout=280)
    for shape in SHAPES:
        for d, op in _pairs():
            ref = reference([make_input(r, d, op, SEED, shape) for r in range(size)], op, d)
            for rank, (out, _) in enumerate(results):
                got, kind = out[(shape, d, op)]
                assert kind == ("Bfloat16Array" if d == "bfloat16" else "cupy.ndarray"), (d, kind)
                _check(got, ref, d, f"seed {SEED} {shape} {d} {op} rank {rank}")
    assert not any(tf_loaded for _, tf_loaded in results), "the nccl path imported TensorFlow"


def w_movement(rank, size, seed):
    cupy, tfcs = _setup(rank)
    rng = np.random.default_rng([seed, 99])
    xs = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(size)]
    r = {"bcast": tfcs.broadcast(cupy.asarray(xs[rank]), size - 1, backend="nccl").get()}
    uneven = np.full((rank + 1, 2), rank, dtype=np.int32)
    r["gather_uneven"] = tfcs.allgather(cupy.asarray(uneven), backend="nccl").get()
    rs_in = np.arange(14, dtype=np.int64).reshape(7, 2) * (rank + 1)
    r["rs_sum"] = tfcs.reduce_scatter(cupy.asarray(rs_in), "sum", backend="nccl").get()
    grads = [cupy.asarray(np.full((3,), rank + 1.0, np.float32)), cupy.asarray(np.full((2, 2), rank, np.int32))]
    r["grouped"] = [g.get() for g in tfcs.grouped_allreduce(grads, "sum", backend="nccl")]
    # all-to-all: rank o sends rank d (o + d) % 3 rows of (o, d, row); compression halves the bytes
    sp = [(rank + d) % 3 for d in range(size)]
    rows = np.array([[rank, d, i] for d in range(size) for i in range(sp[d])], dtype=np.float32).reshape(-1, 3)
    got, got_splits = tfcs.alltoall(cupy.asarray(rows), sp, backend="nccl")
    r["alltoall"] = (got.get(), got_splits)
    r["fp16"] = tfcs.allreduce(cupy.asarray(xs[rank]), "sum", backend="nccl", compression="fp16").get()
    tfcs.barrier(backend="nccl")
    # stream ordering: the producer and the collective on a non-default stream, read right after
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        big = cupy.arange(1 << 22, dtype=cupy.float32) * (rank + 1)  # queued on s
        total = tfcs.allreduce(big, backend="nccl")                   # after the producer, on s
    r["stream_ok"] = bool((total[:5].get() == np.arange(5, dtype=np.float32) * sum(range(1, size + 1))).all())
    r["dlpack"] = None  # a torch GPU tensor comes in through DLPack (torch is on GPU hosts)
    if os.environ.get("TFCS_GPU_DRYRUN") != "1":
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and torch.cuda.is_available():
            t = torch.full((8,), float(rank + 1), device=f"cuda:{cupy.cuda.Device().id}")
            r["dlpack"] = tfcs.allreduce(t, backend="nccl").get()
    r["native_bf16"] = None  # cupy >= 14 has bfloat16 arrays of its own (ml_dtypes.bfloat16)
    try:
        native = cupy.asarray(np.full((4,), rank + 1.5, dtype=BF16))
    except Exception:  # noqa: BLE001 - cupy 13 has no bfloat16 dtype: Bfloat16Array is the way there
        native = None
    if native is not None and str(native.dtype) == "bfloat16":
        tot = tfcs.allreduce(native, "sum", backend="nccl")
        avg = tfcs.allreduce(native, "mean", backend="nccl")
        r["native_bf16"] = (str(tot.dtype), str(avg.dtype), tot.get().astype(np.float32), avg.get().astype(np.float32))
    try:
        tfcs.allreduce(np.ones(3, np.float32), backend="nccl")
        r["cpu_refused"] = "no error"
    except Exception as e:  # noqa: BLE001 - the test wants the class and message
        r["cpu_refused"] = f"{type(e).__name__}: {e}"
    return r, xs


@pytest.mark.timeout(300)
def test_broadcast_allgather_reduce_scatter_grouped_barrier_streams_and_refusals():
    size = gpu_world()
    results = run_workers(w_movement, size, SEED, timeout=280)
    xs = results[0][1]
    rs_total = sum(np.arange(14, dtype=np.int64).reshape(7, 2) * (r + 1) for r in range(size))
    for rank, (r, _) in enumerate(results):
        np.testing.assert_array_equal(r["bcast"], xs[size - 1])
        np.testing.assert_array_equal(r["gather_uneven"],
                                      np.concatenate([np.full((q + 1, 2), q, np.int32) for q in range(size)]))
        np.testing.assert_array_equal(r["rs_sum"], np.array_split(rs_total, size)[rank])
        np.testing.assert_allclose(r["grouped"][0], np.full(3, sum(q + 1.0 for q in range(size))))
        np.testing.assert_array_equal(r["grouped"][1], np.full((2, 2), sum(range(size)), np.int32))
        got, got_splits = r["alltoall"]
        assert got_splits == [(o + rank) % 3 for o in range(size)], got_splits
        want = [[o, rank, i] for o in range(size) for i in range((o + rank) % 3)]
        np.testing.assert_array_equal(got, np.array(want, dtype=np.float32).reshape(-1, 3))
        bound = (2 * size - 1) * 2.0 ** -11 * np.abs(np.stack(xs)).sum(axis=0)
        assert (np.abs(r["fp16"] - np.sum(np.stack(xs).astype(np.float64), axis=0)) <= bound).all()
        assert r["stream_ok"]
        if r["dlpack"] is not None:
            np.testing.assert_array_equal(r["dlpack"], np.full(8, sum(range(1, size + 1)), np.float32))
        if r["native_bf16"] is not None:
            total = sum(q + 1.5 for q in range(size))  # exact in bfloat16 for up to 8 ranks
            assert r["native_bf16"][:2] == ("bfloat16", "bfloat16"), r["native_bf16"]
            np.testing.assert_array_equal(r["native_bf16"][2], np.full(4, total, np.float32))
            np.testing.assert_array_equal(r["native_bf16"][3], np.full(4, total / size, np.float32))
        assert r["cpu_refused"].startswith("UnsupportedOperationError"), r["cpu_refused"]


def w_failures(rank, size):
    cupy, tfcs = _setup(rank)
    from tf_commstrategy.process import default_group
    x = cupy.ones(4, dtype=cupy.float32)
    tfcs.allreduce(x, backend="nccl")  # the communicator is up
    out = {}
    t0 = time.monotonic()
    try:  # rank 0 sends 4 floats, the others 5: NCCL alone would hang or mix data up
        tfcs.allreduce(cupy.ones(4 if rank == 0 else 5, dtype=cupy.float32), backend="nccl", timeout=30)
        out["mismatch"] = "no error"
    except Exception as e:  # noqa: BLE001 - the parent checks class and message
        out["mismatch"] = f"{type(e).__name__}: {e}"
    out["mismatch_s"] = time.monotonic() - t0
    try:
        tfcs.allreduce(x, backend="nccl")
        out["after"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["after"] = type(e).__name__
    out["grpc_failure"] = type(default_group().backend("grpc").failure()).__name__
    return out


def w_missing_rank(rank, size):
    cupy, tfcs = _setup(rank)
    from tf_commstrategy.process import default_group
    tfcs.allreduce(cupy.ones(4, dtype=cupy.float32), backend="nccl")
    grpc = default_group().backend("grpc")
    t0 = time.monotonic()
    if rank == 0:  # the others never join this one: the deadline aborts NCCL's spinning kernel
        try:
            tfcs.allreduce(cupy.ones(1 << 20, dtype=cupy.float32), backend="nccl", timeout=5)
            return "no error", time.monotonic() - t0
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}", time.monotonic() - t0
    while grpc.failure() is None and time.monotonic() - t0 < 60:  # they hear of it over the control plane
        time.sleep(0.05)
    return type(grpc.failure()).__name__, time.monotonic() - t0


@pytest.mark.timeout(300)
def test_a_mismatched_call_and_a_missing_rank_end_in_typed_errors_not_hangs():
    size = gpu_world()
    if size < 2:
        pytest.skip("needs 2 ranks: several GPUs, or TFCS_GPU_EMULATE_HOSTS=2 on one")
    for rank, r in enumerate(run_workers(w_failures, size, timeout=120)):
        assert r["mismatch"].startswith("CollectiveMismatchError"), (rank, r)
        assert "float32[4]" in r["mismatch"] and "float32[5]" in r["mismatch"], (rank, r)
        assert r["mismatch_s"] < 20, (rank, r)  # the verdict, not the 30 s deadline
        assert r["after"] == "CollectiveError", (rank, r)  # the backend stays failed until a restart
    if os.environ.get("TFCS_GPU_DRYRUN") == "1":
        return  # the fake runs calls on the host thread: a missing rank blocks it (tests/multiprocess cover this)
    results = run_workers(w_missing_rank, size, timeout=120)
    what, took = results[0]
    assert what.startswith("CollectiveTimeoutError") and 4.5 < took < 15, results[0]
    for rank in range(1, size):
        assert results[rank][0] != "NoneType" and results[rank][1] < 30, (rank, results[rank])


def w_shared_gpu(rank, size):
    cupy, tfcs = _setup(rank)  # both ranks on GPU 0 of a one-GPU host, one NCCL host
    try:
        tfcs.allreduce(cupy.ones(4, dtype=cupy.float32), backend="nccl", timeout=60)
        return "no error"
    except Exception as e:  # noqa: BLE001 - the parent checks class and message
        return f"{type(e).__name__}: {e}"


@pytest.mark.timeout(200)
def test_two_ranks_on_one_gpu_are_refused_with_the_fix():
    if os.environ.get("TFCS_GPU_DRYRUN") == "1" or os.environ.get("TFCS_GPU_EMULATE_HOSTS") or gpu_world() != 1:
        pytest.skip("needs a host with exactly one GPU, ranks not posing as hosts of their own")
    out = run_workers(w_shared_gpu, 2, expect_failure=True, timeout=150)
    texts = [value for kind, value in out.values()]
    assert all(kind == "ok" for kind, _ in out.values()), out
    assert all(t != "no error" for t in texts), texts  # NCCL refused: nobody went on with a broken job
    assert any(t.startswith("CollectiveError") and "two ranks on one GPU" in t for t in texts), texts
