"""All-reduce of private arrays by cross-memory attach (every rank on one host): each rank reads the
peers' arrays out of their address spaces (process_vm_readv). Results against numpy, the path counted
(so a test cannot pass on the ring alone), in place and out of place, back-to-back calls with new
values, the job-wide agreement (a rank that turns it off or cannot read), and kill -9."""

import os

import numpy as np
import pytest

from tests.helpers import (allreduce_until_killed, cross_memory_max_ranks, leaked_shm_segments, rank_values,
                           reduced_reference, refill_and_allreduce, run_workers)
from tf_commstrategy.backends.host import shm_cma as M_cma
from tf_commstrategy.core import shared_memory as M

pytestmark = pytest.mark.skipif(M.available() is not None, reason=f"no shared memory here: {M.available()}")
MAX_RANKS = cross_memory_max_ranks()


def _needs(size):
    """Skip where the kernel does not let ``size`` sibling processes read each other (Yama, seccomp)."""
    if size > MAX_RANKS:
        pytest.skip(f"process_vm_readv between {size} sibling processes is not allowed here "
                    f"(Yama ptrace_scope {M_cma.yama_scope()}, or refused)")


THRESHOLD = "128K"  # the tests' TFCS_SHM_CMA: small arrays keep the tests fast
N = (1 << 16) + 1001  # elements: 256 KiB + at 4 bytes (above the threshold), segments of unequal length
CASES = [("sum", "float32"), ("mean", "float32"), ("max", "float64"), ("min", "int32"), ("prod", "float64"),
         ("mean", "int64"), ("sum", "float16")]  # float16 sums need a float32 accumulator: the usual path


def _values(rank, dtype, n):
    return rank_values(rank, dtype, n, 2000)


def _reference(size, op, dtype, n):
    return reduced_reference(size, op, dtype, n, 2000)


def _counted(b):
    s = b.stats()
    return s.cma_allreduces, s.direct_allreduces


def _each_op(rank, size):
    import tf_commstrategy as tfcs
    from tf_commstrategy.process import default_group
    tfcs.init(transport="shm", timeout=60)
    b = default_group().backend("grpc")
    out = {"threshold": b.stats().cross_memory_bytes}
    for op, dtype in CASES:
        x = _values(rank, dtype, N)
        y = x.copy()
        got = tfcs.allreduce(y, op=op, out=y)  # in place
        out[(op, dtype, "in")] = (got is y, y)
        out[(op, dtype, "out")] = (tfcs.allreduce(x, op=op), x)  # out of place (result, input: unchanged)
    out["after_ops"] = _counted(b)
    # a 2-D array's middle rows (a contiguous view), the rows around them untouched
    m = np.full((4, N), -1.0, np.float32)
    m[1:3] = _values(rank, "float32", 2 * N).reshape(2, N)
    tfcs.allreduce(m[1:3], out=m[1:3])
    out["rows"] = m
    # below the threshold: the usual path
    s = np.full(1000, rank + 1.0, np.float32)
    out["small"] = tfcs.allreduce(s, out=s)
    out["after"] = _counted(b)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_allreduce_of_private_arrays_reads_the_peers_memory_and_matches_numpy(size):
    _needs(size)
    res = run_workers(_each_op, size, timeout=240, env={"TFCS_SHM_CMA": THRESHOLD})
    narrow = [c for c in CASES if c != ("sum", "float16")]
    for rank, out in enumerate(res):
        assert out["threshold"] == 128 << 10
        for op, dtype in CASES:
            want = _reference(size, op, dtype, N)
            same, _ = out[(op, dtype, "in")]
            assert same  # in place: the result is the array passed
            for how in ("in", "out"):
                got = out[(op, dtype, how)][1 if how == "in" else 0]
                assert got.dtype == np.dtype(dtype)
                if np.dtype(dtype).kind in "iu" or dtype == "float16":
                    np.testing.assert_array_equal(got, want, err_msg=f"{op} {dtype} {how} rank {rank}")
                else:
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{op} {dtype} rank {rank}")
                # each segment is reduced by one rank and copied: every rank holds the same bits
                assert got.tobytes() == res[0][(op, dtype, how)][1 if how == "in" else 0].tobytes()
            np.testing.assert_array_equal(out[(op, dtype, "out")][1], _values(rank, dtype, N))
        # every call above the threshold without a float32 accumulator read the peers' arrays
        assert out["after_ops"] == (2 * len(narrow), 0), out["after_ops"]
        want2 = np.stack([_values(r, "float32", 2 * N) for r in range(size)]).sum(0).reshape(2, N)
        np.testing.assert_allclose(out["rows"][1:3], want2, rtol=1e-5, atol=1e-5)
        assert (out["rows"][[0, 3]] == -1.0).all()
        assert (out["small"] == size * (size + 1) / 2).all()
        assert out["after"] == (2 * len(narrow) + 1, 0), out["after"]


def _repeated_with_new_values(rank, size, calls):
    """Back-to-back all-reduces of one private array, refilled before each call."""
    import tf_commstrategy as tfcs
    from tf_commstrategy.process import default_group
    tfcs.init(transport="shm", timeout=60)
    wrong = refill_and_allreduce(np.empty(1 << 16, np.float64), rank, size, calls)  # 512 KiB
    return wrong, _counted(default_group().backend("grpc"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size,env", [(2, {}), (3, {}), (2, {"TFCS_SHM_FUSION_BYTES": "0"})],
                         ids=["2", "3", "2-fusion-off"])
def test_back_to_back_allreduces_with_new_values_keep_every_call_apart(size, env):
    _needs(size)
    # fusion off: the handshake runs on flag buffers of their own, made at setup
    env = dict(env, TFCS_SHM_CMA=THRESHOLD)
    for wrong, counted in run_workers(_repeated_with_new_values, size, 200, timeout=240, env=env):
        assert wrong == [] and counted == (200, 0), (wrong[:5], counted)


def _agreement(rank, size, how):
    import tf_commstrategy as tfcs
    from tf_commstrategy.backends.host import shm_cma
    from tf_commstrategy.process import default_group
    if how == "one-off" and rank == 1:
        os.environ["TFCS_SHM_CMA"] = "0"
    if how == "thresholds":
        os.environ["TFCS_SHM_CMA"] = ["128K", "1M", "256K"][rank]
    if how == "refused" and rank == 2:  # as in a container whose seccomp filter refuses the call
        def refused(*_):
            raise PermissionError(1, "process_vm_readv: Operation not permitted")
        shm_cma.read = refused
    tfcs.init(transport="shm", timeout=60)
    b = default_group().backend("grpc")
    y = np.full(N, rank + 1.0, np.float32)  # 256 KiB +
    tfcs.allreduce(y, out=y)
    z = np.full(1 << 20, rank + 1.0, np.float32)  # 4 MiB
    tfcs.allreduce(z, out=z)
    return float(y.min()), float(y.max()), float(z.min()), b.stats().cross_memory_bytes, _counted(b)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["one-off", "refused", "thresholds"])
def test_every_rank_takes_the_same_path_whatever_each_rank_asked_for_or_could_do(how):
    _needs(3)
    res = run_workers(_agreement, 3, how, timeout=150, env={"TFCS_SHM_CMA": THRESHOLD})
    for lo, hi, big, threshold, counted in res:
        assert (lo, hi, big) == (6.0, 6.0, 6.0)
        if how == "thresholds":  # the largest threshold asked for: only the 4 MiB call reads the peers
            assert threshold == 1 << 20 and counted == (1, 0), (threshold, counted)
        else:  # one rank turned it off, or could not read: the whole job takes the usual path
            assert threshold == 0 and counted == (0, 0), (threshold, counted)


def _killed_mid_allreduce(rank, size):
    import tf_commstrategy as tfcs
    from tf_commstrategy.process import default_group
    tfcs.init(transport="shm", timeout=60)
    y = np.ones(16 << 20, np.float32)  # 64 MiB: the kill lands inside an all-reduce
    b = default_group().backend("grpc")
    return allreduce_until_killed(y, rank, lambda: _counted(b)[0])


@pytest.mark.timeout(200)
def test_kill9_mid_allreduce_gives_peer_lost_within_the_deadline_and_leaves_no_segment():
    _needs(3)
    before = set(os.listdir(M.SHM_DIR))
    res = run_workers(_killed_mid_allreduce, 3, timeout=150, expect_failure=True)
    assert res[2][0] == "missing"
    for r in (0, 1):
        name, peer, dt, counted = res[r][1]
        assert (name, peer) == ("PeerLostError", 2), res[r]
        assert dt < 15 and counted > 0, res[r]
    assert leaked_shm_segments(before) == []
