"""Shared memory under the ring: fallback when /dev/shm cannot hold a segment, kill -9 mid-allreduce
leaves nothing behind and gives survivors the same typed error as the other data paths."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from tests.helpers import leaked_shm_segments, run_workers
from tf_commstrategy.core import shared_memory as M

pytestmark = pytest.mark.skipif(M.available() is not None, reason=f"no shared memory here: {M.available()}")


def _small_shm(rank, size, only_kind=None):
    import errno
    import time
    import logging
    import tf_commstrategy as tfcs
    from tf_commstrategy.backends.host import shm_transport
    from tf_commstrategy.core import shared_memory
    from tf_commstrategy.process import default_group
    warnings, reports = [], []

    class Grab(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
            elif record.getMessage().startswith("tf_commstrategy: data paths of the job"):
                reports.append(record.getMessage())
    logging.getLogger("tf_commstrategy").addHandler(Grab(level=logging.INFO))
    logging.getLogger("tf_commstrategy").setLevel(logging.INFO)
    if rank == 1:  # as if this rank's /dev/shm were full (a container's 64 MiB default, say)
        create = shared_memory.Segment.create

        def full(size, kind):
            if only_kind is None or kind == only_kind:
                raise OSError(errno.ENOSPC, "No space left on device")
            return create(size, kind)
        shared_memory.Segment.create = staticmethod(full)
    if rank == 2 and only_kind is not None:  # the last rank maps the others' buffers late: they must wait for it
        attach = shared_memory.Segment.attach

        def late(path):
            time.sleep(0.5)
            return attach(path)
        shared_memory.Segment.attach = staticmethod(late)
    tfcs.init()
    got = tfcs.allreduce(np.arange(300_000, dtype=np.float64) * (rank + 1))
    b = default_group().backend("grpc")
    return (b.transport, isinstance(b.layout.ring.inbound, shm_transport.ShmReceiver), got[-3:].tolist(), warnings,
            b.stats().allreduce_path, reports)


def test_too_small_dev_shm_falls_back_to_unix_sockets_with_one_warning_per_job():
    res = run_workers(_small_shm, 3, timeout=120)
    n = 300_000
    for rank, (transport, shm_in, tail, warns, path, reports) in enumerate(res):
        assert tail == [(n - 3) * 6.0, (n - 2) * 6.0, (n - 1) * 6.0]
        assert path == "ring"  # no shared all-reduce buffers either
        assert (len(warns), len(reports)) == ((1, 1) if rank == 0 else (0, 0)), (rank, warns, reports)
    # rank 1 cannot create segments: its inbound (0 -> 1) and outbound (1 -> 2) links use unix sockets
    assert res[0][0] == "unix" and res[1][0] == "unix" and not res[1][1]
    assert res[2][0] == "shm" and not res[2][1]  # 2 -> 0 stays shared memory; 1 -> 2 came in over unix
    # the job's one warning (from rank 0) names the rank, its reason, the links that fell back and the fix
    warning = res[0][3][0]
    assert "rank 1, shared-memory links:" in warning and "No space left" in warning, warning
    assert "links 0->1, 1->2 use Unix sockets" in warning and "--shm-size" in warning, warning
    assert "the all-reduce uses the ring instead of the shared buffers" in warning, warning  # dropped too
    assert res[0][5][0].endswith("(3 ranks on 1 host): ring: unix x2 (0->1, 1->2), shm x1 (2->0)"), res[0][5]


def test_no_room_for_the_shared_all_reduce_buffers_keeps_the_shm_ring_with_one_warning():
    res = run_workers(_small_shm, 3, "fuse", timeout=120)
    n = 300_000
    for rank, (transport, shm_in, tail, warns, path, reports) in enumerate(res):
        assert tail == [(n - 3) * 6.0, (n - 2) * 6.0, (n - 1) * 6.0]
        assert path == "ring" and transport == "shm" and shm_in, (rank, transport, shm_in, path)
        assert len(warns) == (1 if rank == 0 else 0), (rank, warns)
    warning = res[0][3][0]
    assert "rank 1, shared all-reduce buffers:" in warning and "No space left" in warning, warning
    assert "the all-reduce uses the ring" in warning and "Unix sockets" not in warning, warning
    assert res[0][5][0].endswith("ring: shm x3 (0->1, 1->2, 2->0)"), res[0][5]



def _no_bell_mapping(rank, size):
    os.environ["TFCS_SHM_FUSION_BYTES"] = "0"  # the ring carries the all-reduce
    import errno
    import logging
    import tf_commstrategy as tfcs
    from tf_commstrategy.backends.host import shm_transport
    from tf_commstrategy.core import shared_memory
    from tf_commstrategy.process import default_group
    warnings = []

    class Grab(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
    logging.getLogger("tf_commstrategy").addHandler(Grab(level=logging.WARNING))
    if rank == 1:  # this rank maps its neighbours' rings but not their bells (out of mappings, say)
        attach = shared_memory.Segment.attach

        def no_bells(path):
            if "-bell-" in os.path.basename(path):
                raise OSError(errno.ENOMEM, "Cannot allocate memory")
            return attach(path)
        shared_memory.Segment.attach = staticmethod(no_bells)
    tfcs.init(transport="shm", timeout=30)
    got = tfcs.allreduce(np.arange(300_000, dtype=np.float64) * (rank + 1))
    b = default_group().backend("grpc")
    return b.transport, isinstance(b.layout.ring.inbound, shm_transport.ShmReceiver), got[-3:].tolist(), warnings


def test_a_neighbours_bell_that_cannot_be_mapped_falls_back_to_unix_sockets():
    res = run_workers(_no_bell_mapping, 3, timeout=120)
    n = 300_000
    for rank, (transport, shm_in, tail, warns) in enumerate(res):
        assert tail == [(n - 3) * 6.0, (n - 2) * 6.0, (n - 1) * 6.0], rank
    # rank 1 has neither neighbour's bell: 0 -> 1 (it cannot ring 0 when it frees space) and 1 -> 2 use sockets
    assert res[0][0] == "unix" and res[1][0] == "unix" and not res[1][1], res
    assert res[2][0] == "shm" and not res[2][1], res
    assert [len(r[3]) for r in res] == [1, 0, 0], res  # one warning per job, from rank 0, naming rank 1's cause
    warning = res[0][3][0]
    # its first failure (its left neighbour's bell), not the later one it caused (the right neighbour's)
    assert "rank 1, shared-memory links: cannot map rank 0's bell" in warning and "Cannot allocate" in warning, warning
    assert "links 0->1, 1->2 use Unix sockets" in warning, warning


def _killed_mid_allreduce(rank, size, transport):
    if transport in ("shm", "shm-ring"):  # no cross-memory reads (test_cross_memory kills those)
        os.environ["TFCS_SHM_CMA"] = "0"
    if transport == "shm-ring":  # the ring over shared memory, without the shared all-reduce buffers
        os.environ["TFCS_SHM_FUSION_BYTES"] = "0"
        transport = "shm"
    n = 16 << 20  # 64 MiB: the kill lands inside an all-reduce
    if transport == "shm-small":  # a stream of 64-byte calls: the shared buffers' one-round path
        n, transport = 16, "shm"
    import tf_commstrategy as tfcs
    tfcs.init(transport=transport, timeout=60)
    x = np.ones(n, np.float32)
    if rank == 2:
        threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    t_kill = time.time() + 1.5
    try:
        while time.time() < t_kill + 60:
            tfcs.allreduce(x)
    except tfcs.TfcsError as e:
        return type(e).__name__, getattr(e, "peer_rank", None), time.time() - t_kill, os.getpid()
    return "no error", None, 0, os.getpid()


@pytest.mark.timeout(400)
def test_kill9_mid_allreduce_on_shm_leaves_no_segment_and_matches_other_paths():
    # 3 ranks on one host: "shm" all-reduces through the shared buffers, "shm-ring" through the ring
    before = set(os.listdir(M.SHM_DIR))
    outcome = {}
    for transport in ("shm", "shm-small", "shm-ring", "unix"):
        res = run_workers(_killed_mid_allreduce, 3, transport, timeout=150, expect_failure=True)
        assert res[2][0] == "missing"
        outcome[transport] = [(res[r][1][0], res[r][1][1]) for r in (0, 1)]
        for r in (0, 1):
            name, peer, dt, _ = res[r][1]
            assert name == "PeerLostError" and peer == 2, (transport, res[r])
            assert dt < 15, (transport, dt)
    assert outcome["shm"] == outcome["shm-small"] == outcome["unix"] == outcome["shm-ring"]
    assert leaked_shm_segments(before) == []


def _mapped_after_shutdown(rank, size, fusion_bytes):
    os.environ["TFCS_SHM_FUSION_BYTES"] = str(fusion_bytes)
    import tf_commstrategy as tfcs

    def shm_maps():
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                           for line in f if M.PREFIX in line})
    seen = []
    for _ in range(2):  # init, all-reduce, shutdown; twice in one process
        tfcs.init(transport="shm")
        got = tfcs.allreduce(np.full(1 << 18, rank + 1.0, np.float32))
        small = tfcs.allreduce(np.full(4, rank + 1.0, np.float32))  # the buffers' one-round path too
        assert float(small[0]) == float(got[0])
        during = len(shm_maps())
        tfcs.shutdown()
        seen.append((float(got[0]), during, shm_maps()))
    return seen


@pytest.mark.parametrize("fusion_bytes", [0, 8 << 20], ids=["ring", "shared-buffers"])
def test_shutdown_unmaps_every_shared_memory_segment(fusion_bytes):
    # unlinked files stay allocated while mapped: a shutdown that keeps a mapping leaks /dev/shm until exit
    res = run_workers(_mapped_after_shutdown, 3, fusion_bytes, timeout=120)
    for rank, seen in enumerate(res):
        for got, during, after in seen:
            assert got == 6.0
            assert during > 0, (rank, "no shared memory mapped during the job: the test checks nothing")
            assert after == [], (rank, after)


def _neighbour_stalls_in_setup(rank, size, where):
    import tf_commstrategy as tfcs
    from tf_commstrategy.backends.host import shm_buffers, shm_transport
    if rank == 1:  # reaches the shared-memory setup and never publishes its segments
        def stall(*a, **k):
            time.sleep(8)
            raise SystemExit(0)
        if where == "links":
            shm_transport.ShmLinks.__init__ = stall
        else:
            shm_buffers.SharedBuffers.create = stall
    try:
        tfcs.init(transport="shm", rendezvous_timeout=3)
        return "no error", []
    except tfcs.TfcsError as e:
        mine = [f for f in os.listdir(M.SHM_DIR) if f.startswith(f"{M.PREFIX}{os.getpid()}-")]
        return type(e).__name__, mine  # read while this process is alive: not the launcher's cleanup


@pytest.mark.parametrize("where,size", [("links", 2), ("shared-buffers", 3)])
def test_a_setup_that_fails_midway_leaves_no_segment_while_the_process_lives(where, size):
    res = run_workers(_neighbour_stalls_in_setup, size, where, timeout=60, expect_failure=True)
    for rank in range(size):
        if rank != 1:
            status, (name, left) = res[rank]
            assert status == "ok" and name == "RendezvousError" and left == [], (rank, res[rank])


def _drifting_small_allreduces(rank, size, calls):
    import tf_commstrategy as tfcs
    from tf_commstrategy.process import default_group
    tfcs.init()
    rng = np.random.default_rng(rank)
    wrong = []
    for i in range(calls):
        n = 60_000 if i % 37 == 36 else 1 + i % 500  # mostly the one-round path, now and then in pieces
        if rng.random() < 0.1:
            time.sleep(rng.random() * 0.002)  # ranks drift apart: a fast rank runs ahead into the next slot
        x = np.full(n, float(rank * 1000 + i), np.float64)
        got = tfcs.allreduce(x, out=x)
        want = sum(r * 1000 + i for r in range(size))
        if not np.all(got == want):
            wrong.append((i, n, float(got[0]), float(want)))
    return wrong, default_group().backend("grpc").stats().allreduce_path


@pytest.mark.parametrize("size,path", [(4, "shm-buffers"), (2, "ring (small: shm-buffers)")])
def test_back_to_back_small_allreduces_on_the_shared_buffers_keep_every_call_apart(size, path):
    # with 2 ranks the 60,000-element calls take the ring, between the one-round path's calls
    res = run_workers(_drifting_small_allreduces, size, 400, timeout=120)
    assert {r[1] for r in res} == {path}, res
    assert [r[0] for r in res] == [[]] * size, res  # every call's own values, summed, on every rank
