"""Arguments a rank gets wrong on its own are refused on that rank before the collective starts, so
the group stays usable; shapes at the edges (empty trailing dimensions) work; a call whose cut or
path differs between ranks is a typed mismatch naming the other rank's call. Results are checked
against numpy in the parent."""

import numpy as np
import pytest

from tests.helpers import run_workers


def arguments_worker(rank, size):
    import tf_commstrategy as tfcs
    from tf_commstrategy.errors import ConfigurationError, UnsupportedOperationError
    tfcs.init()
    out = {}
    for shape in [(4, 0), (2, 0, 5), (0, 3), (5, 2)]:
        x = np.full(shape, rank + 1, np.float32)
        out[f"rs{shape}"] = tfcs.reduce_scatter(x)
    for bad in (0, -1.0, float("nan"), "soon"):
        try:
            tfcs.allreduce(np.ones(3), timeout=bad)
            out[f"timeout {bad!r}"] = "accepted"
        except ConfigurationError:
            out[f"timeout {bad!r}"] = "ConfigurationError"
    if rank == size - 1:  # only one rank gets it wrong
        ro = np.empty(4, np.float32)
        ro.flags.writeable = False
        try:
            tfcs.allreduce(np.ones(4, np.float32), out=ro)
            out["read-only out"] = "accepted"
        except UnsupportedOperationError:
            out["read-only out"] = "UnsupportedOperationError"
        x = np.ones(4, np.float32)
        x.flags.writeable = False
        try:
            tfcs.allreduce(x, out=x)
            out["read-only in place"] = "accepted"
        except UnsupportedOperationError:
            out["read-only in place"] = "UnsupportedOperationError"
    out["after"] = tfcs.allreduce(np.full(3, rank + 1.0), timeout=30)  # the group is still usable
    tfcs.barrier()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_local_argument_errors_leave_the_group_usable(size):
    results = run_workers(arguments_worker, size, timeout=150)
    total = sum(range(1, size + 1))
    for rank, out in enumerate(results):
        for shape in [(4, 0), (2, 0, 5), (0, 3), (5, 2)]:
            expect = np.array_split(np.full(shape, total, np.float32), size)[rank]
            got = out[f"rs{shape}"]
            assert got.shape == expect.shape, (rank, shape, got.shape, expect.shape)
            np.testing.assert_array_equal(got, expect)
        for bad in (0, -1.0, float("nan"), "soon"):
            assert out[f"timeout {bad!r}"] == "ConfigurationError", (rank, bad)
        if rank == size - 1:
            assert out["read-only out"] == "UnsupportedOperationError"
            assert out["read-only in place"] == "UnsupportedOperationError"
        np.testing.assert_array_equal(out["after"], np.full(3, float(total)))


def tf_out_worker(rank, size):
    import tensorflow as tf
    import tf_commstrategy as tfcs
    from tf_commstrategy.errors import UnsupportedOperationError
    tfcs.init()
    target = np.full(3, -1.0, np.float32)
    try:
        tfcs.allreduce(tf.constant([1.0, 2.0, 3.0]), out=target)
        return "accepted", target
    except UnsupportedOperationError:
        return "UnsupportedOperationError", target


@pytest.mark.timeout(120)
def test_out_with_a_tensor_is_refused_not_ignored():
    (verdict, target), = run_workers(tf_out_worker, 1, timeout=100)
    assert verdict == "UnsupportedOperationError"
    np.testing.assert_array_equal(target, np.full(3, -1.0, np.float32))


def small_vs_large_worker(rank, size):
    from tf_commstrategy.errors import CollectiveMismatchError
    import tf_commstrategy as tfcs
    tfcs.init()
    n = 200_000 if rank == 0 else 10  # rank 0: the large path; the others: the one-round small path
    try:
        tfcs.allreduce(np.ones(n, np.float32), timeout=20)
    except CollectiveMismatchError as e:
        return {"remote_rank": e.remote_rank, "remote": e.remote_signature, "text": str(e)}
    return None


@pytest.mark.timeout(120)
def test_the_mismatch_names_the_call_the_other_rank_made():
    out = run_workers(small_vs_large_worker, 3, timeout=90, expect_failure=True)
    status, mine = out[0]
    assert status == "ok" and mine is not None, out[0]
    assert mine["remote_rank"] in (1, 2)
    assert "shape=(10,)" in mine["remote"], mine
