"""Failure paths: mismatches, timeouts, lost peers, unreachable coordinators, init twice."""

import os
import time

import numpy as np
import pytest

from tests.helpers import free_port, run_workers, wait_for_port, wait_until


def _mismatch(rank, size, kind):
    import tf_commstrategy as tfcs
    tfcs.init()
    tfcs.allreduce(np.ones(3))  # one good collective first
    t_call = time.monotonic()
    try:
        if kind == "dtype":
            tfcs.allreduce(np.ones(4, np.float32 if rank == 0 else np.float64))
        elif kind == "shape":
            tfcs.allreduce(np.ones(4 + rank, np.float32))
        elif kind == "op":
            tfcs.allreduce(np.ones(4), op="sum" if rank == 0 else "max")
        elif kind == "small-large":  # one rank on the shared buffers' one-round path, the others in pieces
            tfcs.allreduce(np.ones(4 if rank == 0 else 1 << 18, np.float32))
        elif kind == "root":
            tfcs.broadcast(np.ones(4), root_rank=rank)
        elif kind == "order":
            if rank == 0:
                tfcs.broadcast(np.ones(4), root_rank=0)
            else:
                tfcs.allreduce(np.ones(4))
    except tfcs.TfcsError as e:
        fail_s = time.monotonic() - t_call
        # the group is now unusable, and says so at once
        t0 = time.monotonic()
        try:
            tfcs.allreduce(np.ones(1))
            again = "no error"
        except tfcs.TfcsError as e2:
            again = str(e2)
        return type(e).__name__, str(e), again, time.monotonic() - t0, fail_s
    return "no error", "", "", 0, 0


@pytest.mark.parametrize("kind", ["dtype", "shape", "op", "small-large", "root", "order"])
def test_mismatch_raises_on_every_rank_naming_both_signatures(kind):
    res = run_workers(_mismatch, 3, kind, timeout=60, env={"TFCS_TIMEOUT": "30"})
    names = [r[0] for r in res]
    assert names == ["CollectiveMismatchError"] * 3, res  # the same class on every rank
    # at least one rank saw both signatures; the others got them in its report
    assert any("this rank called [" in r[1] and "but rank" in r[1] for r in res), res
    for name, msg, again, dt, fail_s in res:
        assert "called [" in msg and msg.count("[") >= 2, msg
        assert "unusable" in again and dt < 1.0
        assert fail_s < 10  # the deadline is 30 s: found at the first message, not at the deadline


def _skip_one(rank, size):
    import tf_commstrategy as tfcs
    tfcs.init(timeout=2)
    if rank == 1:
        time.sleep(4)  # never calls the collective; rank 0 must time out, not hang
        return "skipped", "", 0
    t0 = time.monotonic()
    try:
        tfcs.allreduce(np.ones(10))
    except tfcs.CollectiveTimeoutError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def test_missing_rank_times_out_with_clear_error():
    res = run_workers(_skip_one, 2, timeout=60)
    name, msg, dt = res[0]
    assert name == "CollectiveTimeoutError"
    assert "rank 1" in msg and "timed out after 2 s" in msg and "allreduce" in msg
    assert 1.9 <= dt < 10


def _dies(rank, size):
    import tf_commstrategy as tfcs
    tfcs.init(timeout=120)
    if rank == 1:
        tfcs.allreduce(np.ones(10))
        os._exit(17)  # crash without shutting down (its last message may never leave)
    t0 = time.monotonic()
    try:
        tfcs.allreduce(np.ones(10))
        for _ in range(3):
            tfcs.allreduce(np.ones(1000))
    except tfcs.PeerLostError as e:
        return type(e).__name__, str(e), e.peer_rank, time.monotonic() - t0
    except tfcs.TfcsError as e:
        return type(e).__name__, str(e), None, time.monotonic() - t0
    return "no error", "", None, 0


def test_dead_peer_is_reported_within_seconds_not_at_the_deadline():
    res = run_workers(_dies, 2, timeout=90, expect_failure=True)
    kind, (name, msg, peer, dt) = res[0]
    assert res[1][0] == "missing"
    assert name == "PeerLostError", msg
    assert peer == 1 and "rank 1" in msg
    assert dt < 20  # deadline is 120 s


def _unreachable(rank, size, port):
    import tf_commstrategy as tfcs
    t0 = time.monotonic()
    try:
        tfcs.init(rank=1, world_size=2, coordinator=f"127.0.0.1:{port}", rendezvous_timeout=2)
    except tfcs.RendezvousError as e:
        return type(e).__name__, str(e), e.address, time.monotonic() - t0
    return "no error", "", "", 0


def test_unreachable_coordinator_fails_after_deadline_naming_address():
    port = free_port()
    (name, msg, address, dt), = run_workers(_unreachable, 1, port, timeout=60)
    assert name == "RendezvousError" and address == f"127.0.0.1:{port}"
    assert f"127.0.0.1:{port}" in msg and "within 2 s" in msg
    assert dt < 15


def _init_twice(rank, size):
    import tf_commstrategy as tfcs
    g1 = tfcs.init()
    g2 = tfcs.init()
    same = g1 is g2
    try:
        tfcs.init(timeout=7)
        other = "no error"
    except tfcs.ConfigurationError as e:
        other = str(e)
    v = tfcs.allreduce(np.array([rank + 1]))  # the group is still usable after the refused init
    again = []
    for _ in range(3):  # shutdown, then init again at once in the same process, a few times
        tfcs.shutdown()
        g = tfcs.init()
        again.append(int(tfcs.allreduce(np.array([rank + 1]))[0]))
    return same, other, int(v[0]), again, g is not g1


def test_init_twice_same_settings_harmless_different_is_an_error():
    for same, other, v, again, fresh in run_workers(_init_twice, 2, timeout=90):
        assert same and v == 3 and fresh and again == [3, 3, 3]
        assert "already called with other settings" in other


def _world_one(rank, size):
    import tf_commstrategy as tfcs
    for k in ("TFCS_RANK", "TFCS_WORLD_SIZE", "TFCS_COORDINATOR", "TFCS_LOCAL_RANK"):
        os.environ.pop(k)
    g = tfcs.init()
    return g.store is None, tfcs.rank(), tfcs.size(), tfcs.allreduce(np.arange(3)).tolist()


def test_world_size_one_needs_no_coordinator():
    (no_store, r, n, v), = run_workers(_world_one, 1, timeout=60)
    assert no_store and (r, n, v) == (0, 1, [0, 1, 2])


def _local(rank, size):
    import tf_commstrategy as tfcs
    os.environ.pop("TFCS_LOCAL_RANK")
    tfcs.init()
    return tfcs.local_rank(), tfcs.local_size()


def test_local_rank_and_size_from_hostnames():
    assert run_workers(_local, 3, timeout=60) == [(0, 3), (1, 3), (2, 3)]


def _no_engine() -> str:
    """Drop what the test launcher set (as if no engine had started this worker); the coordinator's
    address, for init() arguments."""
    coordinator = os.environ["TFCS_COORDINATOR"]
    for name in ("TFCS_RANK", "TFCS_WORLD_SIZE", "TFCS_LOCAL_RANK", "TFCS_COORDINATOR"):
        os.environ.pop(name, None)
    return coordinator


def _local_explicit(rank, size):
    import tf_commstrategy as tfcs
    coordinator = _no_engine()
    tfcs.init(rank=rank, world_size=size, coordinator=coordinator)
    return tfcs.local_rank(), tfcs.local_size()


def test_local_rank_with_explicit_ranks_and_no_engine():
    assert run_workers(_local_explicit, 3, timeout=60) == [(0, 3), (1, 3), (2, 3)]


def _short_of_workers(rank, size, late_rank=None):
    import tf_commstrategy as tfcs
    coordinator = _no_engine()
    if rank == late_rank:
        # rank 0's deadline runs from when its coordinator starts; this rank joins 4 s later, so its
        # own deadline comes 4 s after rank 0's, when rank 0 has given up (and, before the fix, stopped
        # its coordinator)
        assert wait_for_port(int(coordinator.rsplit(":", 1)[1]), listening=True)
        time.sleep(4.0)
    try:
        tfcs.init(rank=rank, world_size=4, coordinator=coordinator, rendezvous_timeout=8)
    except tfcs.RendezvousError as e:
        return str(e)
    return "no error"


def test_missing_workers_are_all_named_at_the_rendezvous_deadline():
    res = run_workers(_short_of_workers, 2, timeout=60)  # a job of 4, of which 2 were started
    for msg in res:
        assert "rank(s) [2, 3] of a job of 4 did not join within 8 s" in msg, msg
        assert "TFCS_RENDEZVOUS_TIMEOUT" in msg


def _short_of_workers_rank1_late(rank, size):
    return _short_of_workers(rank, size, late_rank=1)


def test_a_rank_whose_deadline_comes_after_rank_0s_still_learns_which_ranks_are_missing():
    # rank 0 gives up first and would stop its coordinator: rank 1 must get the same answer, not
    # "coordinator call failed"
    res = run_workers(_short_of_workers_rank1_late, 2, timeout=60)
    for msg in res:
        assert "rank(s) [2, 3] of a job of 4 did not join within 8 s" in msg, msg


def _init_fails_then_again(rank, size):
    import tf_commstrategy as tfcs
    from tf_commstrategy.backends.host import transport
    server = transport.DataServer
    if rank == 1:  # this rank's data server cannot start (say, no free port): init fails after the rendezvous
        def broken(*a, **k):
            raise tfcs.RendezvousError("cannot start the data server (injected)", rank=rank)
        transport.DataServer = broken
    try:
        tfcs.init(rendezvous_timeout=3)
        first = "no error"
    except tfcs.RendezvousError as e:
        first = type(e).__name__
    transport.DataServer = server
    if rank == 0:
        time.sleep(6)  # rank 1 comes back meanwhile, once this rank's first coordinator is gone
    else:  # rank 0's failed init stops its coordinator at its deadline (waiting for this rank's address)
        assert wait_for_port(int(os.environ["TFCS_COORDINATOR"].rsplit(":", 1)[1]), listening=False)
    tfcs.init(rendezvous_timeout=30)  # the same coordinator port again: the first one must be gone
    return first, tfcs.allreduce(np.array([rank + 1.0])).tolist()


def test_init_can_be_called_again_after_a_failed_init():
    assert run_workers(_init_fails_then_again, 2, timeout=90) == [("RendezvousError", [3.0])] * 2


def _shutdown_after_a_failure(rank, size):
    import logging
    import tf_commstrategy as tfcs
    warnings = []

    class Grab(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
    logging.getLogger("tf_commstrategy").addHandler(Grab(level=logging.WARNING))
    tfcs.init()
    if rank == 0:  # rank 1 never joins this all-reduce: rank 0 times out and tells it (Abort)
        try:
            tfcs.allreduce(np.ones(4), timeout=2)
        except tfcs.CollectiveTimeoutError:
            pass
        time.sleep(4)  # and stays alive a while: rank 1 leaves first
    else:  # idle while that happens: it only hears of the failure (over the control plane)
        from tf_commstrategy.process import default_group
        grpc = default_group().backend("grpc")
        wait_until(lambda: grpc.failure() is not None, timeout=30)  # else it shuts down as after a clean run
    tfcs.shutdown()
    return [w for w in warnings if "shutdown barrier" in w]


def test_after_a_failure_no_rank_waits_in_the_shutdown_barrier():
    res = run_workers(_shutdown_after_a_failure, 2, timeout=120)
    for rank, barrier_warnings in enumerate(res):
        assert barrier_warnings == [], (rank, barrier_warnings)  # it would wait its 30 s out, then warn


def _two_claim_rank_one(rank, size):
    import tf_commstrategy as tfcs
    from tf_commstrategy.rendezvous.coordinator import CoordinatorClient
    coordinator = _no_engine()
    if rank == 2:  # after the real rank 1 has claimed and published
        watcher = CoordinatorClient(coordinator, rank)
        watcher.wait_ready(60)
        watcher.get("worker/1", 60)
        watcher.close()
    try:
        tfcs.init(rank=min(rank, 1), world_size=2, coordinator=coordinator, rendezvous_timeout=60)
    except tfcs.RendezvousError as e:
        return str(e)
    out = tfcs.allreduce(np.array([1.0])).tolist()
    from tf_commstrategy.process import default_group
    store = default_group().store  # the job is still running when the intruder arrives (and is refused)
    assert wait_until(lambda: int(store.try_get("claim/1") or 0) >= 2, timeout=60)
    return out


def test_a_second_worker_claiming_a_rank_is_refused_and_told_why():
    ok0, ok1, refused = run_workers(_two_claim_rank_one, 3, timeout=90)
    assert ok0 == ok1 == [2.0]
    assert "rank 1 was claimed by 2 workers" in refused and "its own port" in refused, refused


def _reinit_at_once_after_a_failure(rank, size):
    import tf_commstrategy as tfcs
    tfcs.init(rendezvous_timeout=30)
    if rank == 0:  # rank 1 never joins this all-reduce: rank 0 times out and tells it (Abort)
        try:
            tfcs.allreduce(np.ones(4), timeout=2)
        except tfcs.CollectiveTimeoutError:
            pass
        time.sleep(4)  # rank 0 is slow to shut down: its coordinator is still serving meanwhile
    else:  # it hears of the failure
        from tf_commstrategy.process import default_group
        grpc = default_group().backend("grpc")
        wait_until(lambda: grpc.failure() is not None, timeout=30)
    tfcs.shutdown()
    tfcs.init(rendezvous_timeout=30)  # at once, the same coordinator port
    return tfcs.allreduce(np.array([rank + 1.0])).tolist()


def test_init_right_after_a_failed_jobs_shutdown_meets_the_new_coordinator():
    assert run_workers(_reinit_at_once_after_a_failure, 2, timeout=120) == [[3.0], [3.0]]
