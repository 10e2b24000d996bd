"""tfcs.shared_empty: arrays in shared memory whose in-place all-reduce reads the peers' arrays where
they are. Results against numpy, the direct path counted (so a test cannot pass on the copying path
alone), the fallbacks (mixed ranks, other offsets, no shared memory), kill -9 and the mappings."""

import os

import numpy as np
import pytest

from tests.helpers import (allreduce_until_killed, leaked_shm_segments, rank_values, reduced_reference,
                           refill_and_allreduce, run_workers)
from tf_commstrategy.core import shared_memory as M
from tf_commstrategy.backends.host.layout import DIRECT_ABOVE_BYTES

pytestmark = pytest.mark.skipif(M.available() is not None, reason=f"no shared memory here: {M.available()}")

N = DIRECT_ABOVE_BYTES // 2 + 1001  # elements: above the direct path's threshold at 2 bytes each, no round number
CASES = [("sum", "float32"), ("mean", "float32"), ("max", "float64"), ("min", "int32"), ("prod", "float64"),
         ("sum", "float16"), ("mean", "int64")]


def _values(rank, dtype, n):
    return rank_values(rank, dtype, n, 1000)


def _reference(size, op, dtype, n):
    return reduced_reference(size, op, dtype, n, 1000)


def _direct(b):
    return b.stats().direct_allreduces


def _each_op(rank, size):
    import tf_commstrategy as tfcs
    from tf_commstrategy.process import default_group
    tfcs.init(transport="shm", timeout=60)
    b = default_group().backend("grpc")
    out = {"before": _direct(b)}
    for op, dtype in CASES:
        a = tfcs.shared_empty((N,), dtype)
        a[:] = _values(rank, dtype, N)
        got = tfcs.allreduce(a, op=op, out=a)
        out[(op, dtype)] = (got is a, a.copy())
    out["after_ops"] = _direct(b)
    # a slice of a 2-D shared array, the same rows on every rank
    m = tfcs.shared_empty((4, N), np.float32)
    m[:] = -1.0
    m[1:3] = _values(rank, "float32", 2 * N).reshape(2, N)
    tfcs.allreduce(m[1:3], out=m[1:3])
    out["slice"] = m.copy()
    out["after_slice"] = _direct(b)
    # not in place (a new result array): read through the usual path, the input untouched
    a = tfcs.shared_empty(N, np.float32)
    a[:] = _values(rank, "float32", N)
    out["out_of_place"] = (tfcs.allreduce(a), a.copy())
    # mixed: rank 0 passes a shared array, the others private ones; then other offsets on each rank
    x = a if rank == 0 else np.empty(N, np.float32)
    x[:] = _values(rank, "float32", N)
    out["mixed"] = tfcs.allreduce(x, out=x).copy()
    big = tfcs.shared_empty(N + size, np.float32)
    y = big[rank:rank + N]
    y[:] = _values(rank, "float32", N)
    out["offsets"] = tfcs.allreduce(y, out=y).copy()
    # below the threshold: the usual small path, no handshake
    s = tfcs.shared_empty(16, np.float32)
    s[:] = rank + 1
    out["small"] = tfcs.allreduce(s, out=s).copy()
    out["after"] = _direct(b)
    a[:] = _values(rank, "float32", N)  # (rank 0's was reduced in place as the mixed case)
    out["grouped"] = [v.copy() for v in tfcs.grouped_allreduce([a, s])]
    out["stats"] = b.stats()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_in_place_allreduce_of_shared_arrays_matches_numpy_and_reads_the_peers_directly(size):
    res = run_workers(_each_op, size, timeout=240)
    f32 = _reference(size, "sum", "float32", N)
    for rank, out in enumerate(res):
        assert out["before"] == 0
        for op, dtype in CASES:
            same, got = out[(op, dtype)]
            assert same and got.dtype == np.dtype(dtype)
            want = _reference(size, op, dtype, N)
            if np.dtype(dtype).kind in "iu" or dtype == "float16":
                np.testing.assert_array_equal(got, want, err_msg=f"{op} {dtype} rank {rank}")
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{op} {dtype} rank {rank}")
            # one rank reduces each segment: every rank holds the same bits
            assert got.tobytes() == res[0][(op, dtype)][1].tobytes()
        # every in-place call of a whole shared array went straight through the peers' arrays
        assert out["after_ops"] == len(CASES), out["after_ops"]
        want2 = np.stack([_values(r, "float32", 2 * N) for r in range(size)]).sum(0).reshape(2, N)
        np.testing.assert_allclose(out["slice"][1:3], want2, rtol=1e-5, atol=1e-5)
        assert (out["slice"][[0, 3]] == -1.0).all()  # the rows outside the slice are untouched
        assert out["after_slice"] == len(CASES) + 1
        result, kept = out["out_of_place"]
        np.testing.assert_allclose(result, f32, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(kept, _values(rank, "float32", N))
        np.testing.assert_allclose(out["mixed"], f32, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out["offsets"], f32, rtol=1e-5, atol=1e-5)
        assert (out["small"] == size * (size + 1) / 2).all()
        # the out-of-place, mixed, offset and small calls took the usual paths
        assert out["after"] == len(CASES) + 1
        np.testing.assert_allclose(out["grouped"][0], f32, rtol=1e-5, atol=1e-5)
        assert out["stats"].shared_arrays is True


def _repeated_with_new_values(rank, size, calls):
    """Back-to-back direct all-reduces of one shared array, refilled before each call."""
    import tf_commstrategy as tfcs
    from tf_commstrategy.process import default_group
    tfcs.init(transport="shm", timeout=60)
    wrong = refill_and_allreduce(tfcs.shared_empty(1 << 18, np.float64), rank, size, calls)  # 2 MiB
    return wrong, _direct(default_group().backend("grpc"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size,env", [(2, {}), (3, {}), (2, {"TFCS_SHM_FUSION_BYTES": "0", "TFCS_SHM_CMA": "0"})],
                         ids=["2", "3", "2-fusion-off"])
def test_back_to_back_direct_allreduces_with_new_values_keep_every_call_apart(size, env):
    # fusion and cross-memory reads off: the handshake runs on flag buffers made at the first shared_empty
    for wrong, direct in run_workers(_repeated_with_new_values, size, 200, timeout=240, env=env):
        assert wrong == [] and direct == 200, (wrong[:5], direct)


def _without_shared_memory(rank, size, how):
    import tf_commstrategy as tfcs
    from tf_commstrategy.core import shared_memory
    from tf_commstrategy.process import default_group
    if how == "full" and rank == 1:  # this rank's /dev/shm cannot hold the array
        import errno
        create = shared_memory.Segment.create

        def full(size_, kind):
            if kind == "shared":
                raise OSError(errno.ENOSPC, "No space left on device")
            return create(size_, kind)
        shared_memory.Segment.create = staticmethod(full)
    tfcs.init(transport="unix" if how == "unix" else "shm", timeout=60)
    b = default_group().backend("grpc")
    a = tfcs.shared_empty((N,), np.float32)
    a[:] = rank + 1
    tfcs.allreduce(a, out=a)
    return (float(a.min()), float(a.max()), b.stats().shared_arrays, _direct(b), a.flags.writeable,
            len([f for f in open("/proc/self/maps") if "-shared-" in f]))


@pytest.mark.parametrize("how", ["unix", "full"])
def test_without_shared_memory_every_rank_gets_private_arrays_that_reduce_as_usual(how):
    res = run_workers(_without_shared_memory, 3, how, timeout=120)
    for lo, hi, shared, direct, writeable, maps in res:
        assert (lo, hi) == (6.0, 6.0)
        assert shared is False and direct == 0 and writeable and maps == 0


def _mismatched_sizes(rank, size):
    import tf_commstrategy as tfcs
    tfcs.init(transport="shm", timeout=30)
    try:
        tfcs.shared_empty(100 + rank, np.float32)
    except tfcs.CollectiveMismatchError as e:
        first = str(e)
    else:
        return "no error", None
    try:  # the group is unusable afterwards, as after a failed collective
        tfcs.allreduce(np.ones(4, np.float32))
    except tfcs.TfcsError as e:
        return first, type(e).__name__
    return first, "no error"


def test_ranks_asking_for_different_shapes_get_a_mismatch_error_and_the_group_stops():
    res = run_workers(_mismatched_sizes, 2, timeout=120)
    assert "rank 1 asked for shape=(101,)" in res[0][0] and "this rank asked for shape=(100,)" in res[0][0], res
    assert "rank 0 asked for shape=(100,)" in res[1][0]
    assert {r[1] for r in res} <= {"CollectiveError", "CollectiveAbortedError"}, res


def _killed_mid_direct(rank, size):
    import tf_commstrategy as tfcs
    tfcs.init(transport="shm", timeout=60)
    y = tfcs.shared_empty(16 << 20, np.float32)  # 64 MiB: the kill lands inside an all-reduce
    y[:] = 1.0
    from tf_commstrategy.process import default_group
    b = default_group().backend("grpc")
    return allreduce_until_killed(y, rank, lambda: _direct(b))


@pytest.mark.timeout(200)
@pytest.mark.skipif(M.free_mib() < 512, reason="needs 3 x 64 MiB of /dev/shm for the shared arrays")
def test_kill9_mid_direct_allreduce_leaves_no_segment_and_gives_peer_lost():
    before = set(os.listdir(M.SHM_DIR))
    res = run_workers(_killed_mid_direct, 3, timeout=150, expect_failure=True)
    assert res[2][0] == "missing"
    for r in (0, 1):
        name, peer, dt, direct = res[r][1]
        assert (name, peer) == ("PeerLostError", 2), res[r]
        assert dt < 15 and direct > 0, res[r]
    assert leaked_shm_segments(before) == []


def _mappings_after_shutdown(rank, size):
    import gc
    import tf_commstrategy as tfcs

    def shared_maps():
        with open("/proc/self/maps") as f:
            return len([line for line in f if "-shared-" in line])
    tfcs.init(transport="shm", timeout=60)
    a = tfcs.shared_empty(N, np.float32)
    a[:] = 1.0
    tfcs.allreduce(a, out=a)
    during = shared_maps()
    tfcs.shutdown()
    kept = shared_maps()
    a += 1.0  # still this process's memory: the array outlives the group, its peers' mappings do not
    value = float(a[0])
    del a
    gc.collect()
    return during, kept, value, shared_maps()


def test_shutdown_unmaps_the_peers_arrays_and_the_own_one_goes_with_its_last_view():
    for during, kept, value, after in run_workers(_mappings_after_shutdown, 3, timeout=120):
        assert during == 3 and kept == 1 and value == 4.0 and after == 0
