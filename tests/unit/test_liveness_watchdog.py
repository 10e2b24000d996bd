"""The heartbeat watchdog with fake probes: when a silent peer is declared lost, and for what."""

import threading
import time

import grpc

from tf_commstrategy.backends.host.liveness import Watchdog
from tf_commstrategy.errors import PeerLostError


class _Timeout(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


class _Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "failed to connect to all addresses; Connection refused"


class _Probe:
    """Answers until ``freeze()``; then every ping waits its whole timeout and fails (a frozen peer)."""

    address = "127.0.0.1:1"

    def __init__(self, refuse=False):
        self.frozen_at = None
        self.refuse = refuse
        self.timeouts = []

    def freeze(self):
        self.frozen_at = time.monotonic()

    def ping(self, timeout):
        if self.frozen_at is None:
            return {"rank": 1, "started": 0, "failed": False}
        self.timeouts.append(timeout)
        if self.refuse:
            raise _Refused()
        time.sleep(timeout)
        raise _Timeout()

    def close(self):
        pass


def _watch(probe, timeout, interval=0.2):
    lost = []
    done = threading.Event()

    def on_lost(rank, err):
        lost.append((rank, err, time.monotonic()))
        done.set()
    w = Watchdog(0, [1], {1: probe}, lambda r: f"host h, pid {100 + r}", on_lost, interval=interval,
                 timeout=timeout)
    return w, lost, done


def test_a_frozen_peer_is_declared_lost_when_its_silence_reaches_the_limit_not_a_ping_timeout_later():
    probe = _Probe()
    w, lost, done = _watch(probe, timeout=3.0, interval=0.2)
    try:
        time.sleep(0.5)  # a few good pings first
        probe.freeze()
        assert done.wait(15)
    finally:
        w.stop()
    rank, err, at = lost[0]
    silent = at - probe.frozen_at
    assert rank == 1 and isinstance(err, PeerLostError) and err.peer_rank == 1
    assert "has not answered heartbeats" in str(err) and "limit 3 s" in str(err)
    # the last good ping was at most one interval before the freeze: the verdict is due at 3 s of
    # silence; without the deadline-aware ping it came one 2 s ping later (4.4 s or more)
    assert 2.7 <= silent <= 4.1, silent
    assert max(probe.timeouts) <= 2.0 and min(probe.timeouts) < 2.0, probe.timeouts


def test_a_refusing_port_is_declared_gone_on_the_second_refusal_long_before_the_limit():
    probe = _Probe(refuse=True)
    w, lost, done = _watch(probe, timeout=30.0, interval=0.1)
    try:
        time.sleep(0.3)
        probe.freeze()
        assert done.wait(10)
    finally:
        w.stop()
    rank, err, at = lost[0]
    assert "is gone: its port refuses connections" in str(err)
    assert at - probe.frozen_at < 2.0 and len(probe.timeouts) == 2


def test_heartbeats_off_start_no_thread():
    probe = _Probe()
    w, lost, done = _watch(probe, timeout=0.0)
    assert not w._thread.is_alive()
    w.stop()
