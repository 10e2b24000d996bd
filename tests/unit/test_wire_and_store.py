import contextlib
import threading
import time

import numpy as np
import pytest

from tf_commstrategy.backends.host import wire
from tf_commstrategy.errors import PeerLostError, RendezvousError
from tf_commstrategy.rendezvous.coordinator import CoordinatorClient, CoordinatorServer
from tests.helpers import free_port


def test_encode_decode_roundtrip_without_copying_payload():
    payload = np.arange(5, dtype=np.float32)
    msg = wire.encode(7, 2, 3, 1, b"allreduce sum", payload.view(np.uint8))
    seq, step, chunk, sender, sig, view = wire.decode(msg, world_size=2)
    assert (seq, step, chunk, sender, sig) == (7, 2, 3, 1, b"allreduce sum")
    np.testing.assert_array_equal(np.frombuffer(view, np.float32), payload)


@pytest.mark.parametrize("msg", [b"", b"XXXX" + bytes(40), wire.encode(1, 0, 0, 9, b"s", b"")])
def test_malformed_messages_are_rejected(msg):
    with pytest.raises(wire.MalformedMessage):
        wire.decode(msg, world_size=2)


def test_mailbox_take_waits_until_deadline_then_returns_none():
    mb = wire.Mailbox()
    deadline = time.monotonic() + 0.2
    assert mb.take((0, 0, 0), deadline, sender=1) is None
    assert time.monotonic() >= deadline  # it returned at its deadline, not before
    threading.Timer(0.1, mb.deposit, args=((0, 0, 0), b"s", memoryview(b"x"))).start()
    assert mb.take((0, 0, 0), time.monotonic() + 5, sender=1)[0] == b"s"


def test_mailbox_peer_gone_fails_waiters_at_once():
    mb = wire.Mailbox()
    threading.Timer(0.1, mb.peer_gone, args=(1, PeerLostError("gone", peer_rank=1))).start()
    t0 = time.monotonic()
    with pytest.raises(PeerLostError):
        mb.take((0, 0, 0), time.monotonic() + 30, sender=1)
    assert time.monotonic() - t0 < 5


def test_mailbox_drops_frames_of_finished_or_far_future_collectives():
    mb = wire.Mailbox()
    seen = []
    mb.on_reject = seen.append
    assert mb.deposit((0, 0, 0), b"s", memoryview(b"x"))
    mb.take((0, 0, 0), time.monotonic() + 1, sender=1)
    mb.forget(0)
    assert not mb.deposit((0, 1, 0), b"s", memoryview(b"x"))                    # finished
    assert not mb.deposit((1 + wire.SEQ_WINDOW + 1, 0, 0), b"s", memoryview(b"x"))  # names no collective yet
    assert mb.deposit((1, 0, 0), b"s", memoryview(b"x")) and mb.deposit((2, 0, 0), b"s", memoryview(b"x"))
    assert mb.rejected == 2 and len(seen) == 1 and "#0" in seen[0]  # logged once
    assert mb.pending() == 2


def test_coordinator_rejects_malformed_requests_and_keeps_its_store():
    import grpc
    from tf_commstrategy.core import grpc_util
    port = free_port()
    srv = CoordinatorServer(f"127.0.0.1:{port}", world_size=2)
    try:
        good = CoordinatorClient(f"127.0.0.1:{port}", 0)
        good.set("k", "v")
        ch = grpc_util.open_channel(f"127.0.0.1:{port}")
        bad = [("Set", b"not json"), ("Set", b"[1, 2]"), ("Set", b'{"key": 5, "value": "x"}'),
               ("Set", b'{"key": "k"}'), ("Get", b'{"key": "k", "wait_s": 1e9}'),
               ("Add", b'{"key": "n", "amount": "1"}'), ("Add", b'{"key": "n", "amount": 99999999999999}'),
               ("Barrier", b'{"name": "b", "rank": 7, "world": 2}'), ("Barrier", b'{"name": "b", "rank": 0, "world": 9}'),
               ("Set", ('{"key": "%s", "value": "x"}' % ("k" * 10000)).encode())]
        for method, body in bad:
            with pytest.raises(grpc.RpcError) as e:
                grpc_util.unary(ch, "Coordinator", method)(body, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, body)
        assert good.get("k", timeout=1) == "v" and good.add("n", 2) == 2
        ch.close()
        good.close()
    finally:
        srv.stop()


def test_coordinator_store_and_barrier():
    port = free_port()
    srv = CoordinatorServer(f"127.0.0.1:{port}", world_size=2)
    try:
        a = CoordinatorClient(f"127.0.0.1:{port}", 0)
        b = CoordinatorClient(f"127.0.0.1:{port}", 1)
        a.wait_ready(5)
        threading.Timer(0.2, b.set, args=("k", "v")).start()
        assert a.get("k", timeout=5) == "v"
        assert a.add("n") == 1 and b.add("n") == 1 + 1
        t = threading.Thread(target=b.barrier, args=("x", 2, 5))
        t.start()
        a.barrier("x", 2, 5)
        t.join(5)
        with pytest.raises(RendezvousError, match=r"ranks \[1\] never arrived"):
            a.barrier("y", 2, 0.5)
        with pytest.raises(RendezvousError, match="did not appear"):
            a.get("missing", timeout=0.3)
    finally:
        srv.stop()


def test_coordinator_rejects_calls_without_the_job_token():
    port = free_port()
    srv = CoordinatorServer(f"127.0.0.1:{port}", world_size=1, token="s3cret")
    try:
        good = CoordinatorClient(f"127.0.0.1:{port}", 0, token="s3cret")
        good.wait_ready(5)
        good.set("k", "v")
        bad = CoordinatorClient(f"127.0.0.1:{port}", 0, token="wrong")
        with pytest.raises(RendezvousError, match="rejected this worker's job token"):
            bad.get("k", timeout=1)
        none = CoordinatorClient(f"127.0.0.1:{port}", 0)
        with pytest.raises(RendezvousError, match="job token"):
            none.set("k", "evil")
        assert good.get("k", timeout=1) == "v"
    finally:
        srv.stop()


def test_unreachable_coordinator_names_the_address():
    port = free_port()
    c = CoordinatorClient(f"127.0.0.1:{port}", 1)
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=f"127.0.0.1:{port} within 1 s"):
        c.wait_ready(1.0)
    assert time.monotonic() - t0 < 10


def test_coordinator_gone_during_the_meeting_is_reported_as_such():
    # rank 0's coordinator stops while rank 1 waits for the others: the error names the coordinator,
    # not every rank of the job as "did not join"
    from tf_commstrategy.rendezvous.cluster_env import ClusterSpec
    from tf_commstrategy.rendezvous.rendezvous import _gather_workers
    port = free_port()
    address = f"127.0.0.1:{port}"
    srv = CoordinatorServer(address, world_size=3)
    c = CoordinatorClient(address, 1)
    c.wait_ready(5)
    c.set("worker/1", "{}")
    srv.stop()
    spec = ClusterSpec(rank=1, world_size=3, local_rank=None, coordinator=address, source="test")
    with pytest.raises(RendezvousError) as info:
        _gather_workers(c, spec, 30.0, time.monotonic() + 30.0, hosts_coordinator=False)
    text = str(info.value)
    assert "did not join" not in text and f"coordinator call Get to {address} failed" in text, text
    assert "rank 0" in text
    c.close()


@contextlib.contextmanager
def _meeting(rank, world, published):
    """A coordinator for a job of ``world``, and rank ``rank``'s client after the ranks in ``published``
    have set their worker keys; yields (client, the rank's ClusterSpec)."""
    from tf_commstrategy.rendezvous.cluster_env import ClusterSpec
    address = f"127.0.0.1:{free_port()}"
    srv = CoordinatorServer(address, world_size=world)
    c = CoordinatorClient(address, rank)
    try:
        c.wait_ready(5)
        for r in published:
            c.set(f"worker/{r}", "{}")
        yield c, ClusterSpec(rank=rank, world_size=world, local_rank=None, coordinator=address, source="test")
    finally:
        c.close()
        srv.stop()


def test_missing_ranks_are_named_while_the_coordinator_answers():
    from tf_commstrategy.rendezvous.rendezvous import _gather_workers
    with _meeting(1, 3, published=[1]) as (c, spec):
        with pytest.raises(RendezvousError, match=r"rank\(s\) \[0, 2\] of a job of 3 did not join"):
            _gather_workers(c, spec, 0.3, time.monotonic() + 0.3, hosts_coordinator=False)
        assert c.try_get("worker/1") == "{}" and c.try_get("worker/2") is None
        # what it saw is published for the ranks whose deadlines come later, and it acknowledged it
        assert c.try_get("rendezvous/failed") == "rank(s) [0, 2] of a job of 3 did not join within 0 s"
        assert c.add("rendezvous/failed_seen", 0) == 1


def test_a_published_rendezvous_failure_ends_the_wait_of_the_ranks_that_joined():
    from tf_commstrategy.rendezvous.rendezvous import _gather_workers
    with _meeting(2, 3, published=[0, 2]) as (c, spec):
        threading.Timer(0.3, c.set, args=("rendezvous/failed", "rank(s) [1] of a job of 3 did not join")).start()
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match=r"rank 2: rank\(s\) \[1\] of a job of 3 did not join"):
            _gather_workers(c, spec, 60.0, time.monotonic() + 60.0, hosts_coordinator=False)
        assert time.monotonic() - t0 < 10  # not its own 60 s deadline
        assert c.add("rendezvous/failed_seen", 0) == 1


def test_get_either_returns_the_first_key_set_and_prefers_the_first_key():
    address = f"127.0.0.1:{free_port()}"
    srv = CoordinatorServer(address, world_size=1)
    try:
        c = CoordinatorClient(address, 0)
        c.wait_ready(5)
        threading.Timer(0.2, c.set, args=("b", "2")).start()
        assert c.get_either("a", "b", timeout=5) == ("b", "2")
        c.set("a", "1")
        assert c.get_either("a", "b", timeout=5) == ("a", "1")
        assert c.get("a", timeout=1) == "1"
        with pytest.raises(RendezvousError, match="did not appear"):
            c.get_either("x", "y", timeout=0.3)
        c.close()
    finally:
        srv.stop()
