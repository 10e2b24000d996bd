"""The shared-memory ring in one process: frames in order across the wrap, a full ring queues frames
until space is freed, releases, mismatches, a closed producer, deadlines, and segment hygiene."""

import os
import time

import numpy as np
import pytest

from tf_commstrategy.core import shared_memory as M
from tf_commstrategy.backends.host import shm_transport as S
from tf_commstrategy.errors import PeerLostError

pytestmark = pytest.mark.skipif(M.available() is not None, reason=f"no shared memory here: {M.available()}")


def _pair(chunk_bytes=64 << 10, peer_pid=None):
    ring = M.Segment.create(S.ring_bytes(chunk_bytes), "ring")
    bell_a = M.Segment.create(M.BELL_BYTES, "bell")
    bell_b = M.Segment.create(M.BELL_BYTES, "bell")
    pid = peer_pid or os.getpid()
    describe = lambda r: f"pid {pid}"  # noqa: E731
    tx = S.ShmSender(M.Segment.attach(ring.path), M.Bell(M.Segment.attach(bell_b.path)),
                     S._Waiter(M.Bell(bell_a), 1, pid, 0, describe, 0.0), 0, 1)
    rx = S.ShmReceiver(ring, M.Bell(bell_a), S._Waiter(M.Bell(bell_b), 0, pid, 1, describe, 0.0), 1, 0)
    for seg in (ring, bell_a, bell_b):
        seg.unlink()
    return tx, rx


def test_segments_are_private_and_unlinked_once_mapped():
    seg = M.Segment.create(4096, "ring")
    try:
        st = os.stat(seg.path)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
        assert os.path.basename(seg.path).startswith(f"{M.PREFIX}{os.getpid()}-")
        other = M.Segment.attach(seg.path)
        seg.unlink()
        assert not os.path.exists(seg.path)
        other.u8[100] = 7  # the mapping outlives the name
        assert seg.u8[100] == 7
        other.close()
    finally:
        seg.unlink()
        seg.close()


def test_attach_refuses_foreign_paths_and_modes(tmp_path):
    with pytest.raises(OSError):
        M.Segment.attach(str(tmp_path / "x"))
    seg = M.Segment.create(4096, "ring")
    try:
        os.chmod(seg.path, 0o644)
        with pytest.raises(OSError, match="mode"):
            M.Segment.attach(seg.path)
    finally:
        seg.unlink()
        seg.close()


def test_frames_arrive_in_order_across_many_wraps_and_full_ring_queues():
    tx, rx = _pair()
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(0, 60 << 10, 400)]
    payloads = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    sent = got = 0
    queued_peak = 0
    while got < len(payloads):
        # the producer runs ahead as far as the ring allows; the rest queues
        while sent < len(payloads) and len(tx._pending) < 8:
            tx.send_frame(5, sent, 0, b"sig", payloads[sent])
            sent += 1
        queued_peak = max(queued_peak, len(tx._pending))
        sig, view = rx.take((5, got, 0), time.monotonic() + 5, b"sig", outbound=tx)
        assert sig == b"sig" and np.array_equal(view, payloads[got]), got
        got += 1
    rx.release()
    tx.drain(5)
    assert queued_peak > 0  # the ring did fill up
    assert not tx._pending and int(rx._ctl[S.HEAD]) == rx._tail  # everything consumed, nothing left


def test_mismatched_frames_are_reported_not_delivered():
    tx, rx = _pair()
    tx.send_frame(3, 0, 0, b"allreduce sum", np.zeros(4, np.uint8))
    sig, payload = rx.take((3, 0, 0), time.monotonic() + 5, b"allreduce max")
    assert sig == b"allreduce sum"  # the caller compares and raises CollectiveMismatchError
    tx.send_frame(4, 0, 0, b"x", np.zeros(4, np.uint8))
    sig, payload = rx.take((9, 0, 0), time.monotonic() + 5, b"x")
    assert payload is None and b"#4" in sig  # another collective entirely


def test_receiver_times_out_at_the_deadline_and_sees_a_clean_close():
    tx, rx = _pair()
    t0 = time.monotonic()
    assert rx.take((0, 0, 0), time.monotonic() + 0.3, b"s") is None
    assert 0.29 <= time.monotonic() - t0 < 2
    tx.close()
    with pytest.raises(PeerLostError, match="shut down its process group"):
        rx.take((0, 0, 0), time.monotonic() + 5, b"s")


def test_a_dead_peer_is_noticed_within_a_slice():
    import subprocess
    p = subprocess.Popen(["sleep", "30"])
    try:
        tx, rx = _pair(peer_pid=p.pid)
        p.kill()
        p.wait()
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match="is gone"):
            rx.take((0, 0, 0), time.monotonic() + 30, b"s")
        assert time.monotonic() - t0 < 1
    finally:
        p.kill()


def test_stale_segments_of_dead_creators_are_removed():
    import subprocess
    p = subprocess.Popen(["true"])
    p.wait()
    ns = os.stat("/proc/self/ns/pid").st_ino
    dead = os.path.join(M.SHM_DIR, f"{M.PREFIX}{p.pid}-ring-deadbeef.{ns}")
    older = os.path.join(M.SHM_DIR, f"{M.PREFIX}{p.pid}-bell-deadbeef")  # named before namespaces were
    # a dead pid here may be a live process in another container sharing /dev/shm: left alone
    foreign = os.path.join(M.SHM_DIR, f"{M.PREFIX}{p.pid}-ring-deadbeef.{ns + 1}")
    alive = M.Segment.create(4096, "ring")
    for path in (dead, older, foreign):
        open(path, "w").close()
    try:
        assert M.remove_stale_segments() >= 2
        assert not os.path.exists(dead) and not os.path.exists(older)
        assert os.path.exists(alive.path) and os.path.exists(foreign)
        assert alive.path.endswith(f".{ns}")
    finally:
        alive.unlink()
        alive.close()
        for path in (dead, older, foreign):
            if os.path.exists(path):
                os.unlink(path)


class _CountingFutex:
    def __init__(self, real):
        self.real, self.wakes = real, 0

    def wake(self, addr):
        self.wakes += 1
        self.real.wake(addr)

    def wait(self, addr, expected, timeout_s):
        self.real.wait(addr, expected, timeout_s)


@pytest.mark.skipif(M._atomic_add is None, reason="without libatomic every ring wakes")
@pytest.mark.parametrize("x86", [True, False], ids=["x86-ordering", "other-cpus-ordering"])
def test_a_bell_makes_the_wake_up_call_only_for_a_sleeper_and_wakes_it(monkeypatch, x86):
    import threading
    counting = _CountingFutex(M.futex())
    monkeypatch.setattr(M, "futex", lambda: counting)
    monkeypatch.setattr(M, "_X86", x86)  # the other branch reads the sleeper count with an atomic
    seg = M.Segment.create(M.BELL_BYTES, "bell")
    try:
        seg.unlink()
        ringer, sleeper = M.Bell(seg), M.Bell(seg)
        ringer.ring()
        assert counting.wakes == 0 and sleeper.value() == 1  # nobody asleep: no syscall, the word moved
        seen = sleeper.value()
        woke = threading.Event()

        def sleep():
            sleeper.wait(seen, 30.0)  # returns when rung, long before this timeout
            woke.set()

        t = threading.Thread(target=sleep, daemon=True)
        t.start()
        end = time.monotonic() + 10
        while int(np.frombuffer(seg.mm, np.uint32, 2)[1]) == 0 and time.monotonic() < end:
            time.sleep(0.001)  # until the sleeper has counted itself
        time.sleep(0.05)  # and is inside futex(2) (or about to be: then it sees the word move)
        ringer.ring()
        assert woke.wait(10), "the sleeper was not woken"
        assert counting.wakes == 1
        t.join(5)
        assert int(np.frombuffer(seg.mm, np.uint32, 2)[1]) == 0  # it uncounted itself
        sleeper.wait(seen, 30.0)  # the word has moved since `seen`: returns at once
    finally:
        seg.close()


def test_a_segment_that_cannot_be_mapped_is_not_left_behind(monkeypatch):
    import mmap as mmap_mod

    def refuse(*a, **k):
        raise OSError(12, "Cannot allocate memory")
    before = set(os.listdir(M.SHM_DIR))
    monkeypatch.setattr(M.mmap, "mmap", refuse)
    with pytest.raises(OSError, match="Cannot allocate"):
        M.Segment.create(4096, "ring")
    monkeypatch.setattr(M.mmap, "mmap", mmap_mod.mmap)
    mine = [n for n in set(os.listdir(M.SHM_DIR)) - before if n.startswith(f"{M.PREFIX}{os.getpid()}-")]
    assert mine == []


def test_links_opened_before_a_failure_while_connecting_are_closed(monkeypatch):
    # the shared-memory receiver is set up, then connecting to the right neighbour fails (its address
    # never appears): the ring closes what it had opened before the error goes up
    from types import SimpleNamespace
    from tf_commstrategy.backends.host import links as L
    from tf_commstrategy.errors import RendezvousError
    closed = []

    class Part:
        def __init__(self, name):
            self.name = name

        def close(self, *a, **k):
            closed.append(self.name)

    class FakeShm:
        def __init__(self, *a, **k):
            self.receiver, self.sender = Part("shm receiver"), None
            self.fell_back = False

        def close(self):  # pragma: no cover - RingLinks closes the parts itself
            raise AssertionError("not used")

    class Store:
        def get(self, key, timeout):
            raise RendezvousError(f"key {key!r} did not appear")

    monkeypatch.setattr(L, "link_kinds", lambda w, members, requested, tls=False: ["shm", "tcp"])
    monkeypatch.setattr(L.shm_transport, "ShmLinks", FakeShm)
    worker = SimpleNamespace(host_key="h", pid=1)
    backend = SimpleNamespace(rank=1, group=SimpleNamespace(workers=[worker, worker], store=Store(), token=None,
                                                            rendezvous_timeout=1.0, tls=None),
                              describe=str, chunk_bytes=1 << 20)
    with pytest.raises(RendezvousError):
        L.RingLinks(backend, 0, [0, 1], "tcp")
    assert closed == ["shm receiver"]


def test_fence_off_x86_is_a_thread_fence_not_an_atomic_on_another_word(monkeypatch):
    """Off x86 the frame's bytes must be ordered before ``head`` by a full barrier. A read-modify-write
    of an unrelated word is not one on arm64 (load-acquire / store-release), so ``fence`` must call C11
    ``atomic_thread_fence`` (or, without it, make a futex syscall); on x86 it does nothing."""
    calls = []
    if M._thread_fence is not None:  # the real function runs (a fence on this CPU) and is recorded
        real = M._thread_fence
        monkeypatch.setattr(M, "_thread_fence", lambda order: (calls.append(("fence", order)), real(order)))
    else:
        monkeypatch.setattr(M, "_thread_fence", lambda order: calls.append(("fence", order)))
    if M._atomic_add is not None:
        monkeypatch.setattr(M, "_atomic_add", lambda *a: calls.append(("rmw",) + a[1:]) or 0)
    monkeypatch.setattr(M, "_X86", False)
    M.fence()
    assert calls == [("fence", M._SEQ_CST)]
    monkeypatch.setattr(M, "_X86", True)
    M.fence()
    assert calls == [("fence", M._SEQ_CST)]  # x86: no barrier needed (stores, and loads, stay in order)
    counting = _CountingFutex(M.futex())  # no atomic_thread_fence in this libatomic: a futex syscall
    monkeypatch.setattr(M, "futex", lambda: counting)
    monkeypatch.setattr(M, "_thread_fence", None)
    monkeypatch.setattr(M, "_X86", False)
    M.fence()
    assert counting.wakes == 1 and len(calls) == 1


@pytest.mark.skipif(M._atomic_add is None, reason="no libatomic on this machine")
def test_libatomic_provides_the_thread_fence():
    assert M._thread_fence is not None  # GCC >= 7's libatomic exports it: the fast path is the one used


class _Store:
    """The coordinator's key-value store as ShmLinks sees it: a missing key is a deadline."""

    def __init__(self, on_missing=None):
        self.kv, self.on_missing = {}, on_missing

    def set(self, key, value):
        self.kv[key] = value

    def get(self, key, timeout):
        if key not in self.kv:
            if self.on_missing is not None:
                self.on_missing()
            from tf_commstrategy.errors import RendezvousError
            raise RendezvousError(f"no {key} within {timeout} s")
        return self.kv[key]


def test_a_neighbour_killed_during_setup_leaves_no_segment_once_the_survivor_raises():
    """The neighbour created and published its segments, then was killed (kill -9) before unlinking
    them: the survivor, failing its setup, removes them with its own."""
    import json
    import signal
    import subprocess
    import sys
    from tf_commstrategy.errors import RendezvousError
    code = ("import sys, time; from tf_commstrategy.core import shared_memory as M; from tf_commstrategy.backends.host import shm_transport as S; "
            "b = M.Segment.create(M.BELL_BYTES, 'bell'); r = M.Segment.create(S.ring_bytes(1 << 16), 'ring'); "
            "print(b.path, r.path, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        bell, ring = child.stdout.readline().split()
    except BaseException:
        child.kill()
        raise

    def killed():  # the neighbour dies while the survivor waits for it (after the start-up sweep)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    store = _Store(on_missing=killed)
    store.set("shm/seg/1", json.dumps({"bell": bell, "ring": ring, "why": None}))
    before = set(os.listdir(M.SHM_DIR))
    with pytest.raises(RendezvousError):  # the dead neighbour never says it mapped mine
        S.ShmLinks(store, 0, 1, 1, True, True, [os.getpid(), child.pid], str, 1 << 16, 0.1, 0.0)
    assert child.returncode is not None
    assert not os.path.exists(bell) and not os.path.exists(ring)
    # and none of the survivor's own (other tests' segments may come and go meanwhile: pytest -n 2)
    mine = f"{M.PREFIX}{os.getpid()}-"
    assert {f for f in os.listdir(M.SHM_DIR) if f.startswith(mine)} <= before


def test_segments_of_a_creator_whose_pid_namespace_is_unknown_are_swept_too(monkeypatch):
    real_stat = os.stat

    def no_proc_ns(path, *a, **k):
        if str(path) == "/proc/self/ns/pid":
            raise PermissionError(path)
        return real_stat(path, *a, **k)
    monkeypatch.setattr(M.os, "stat", no_proc_ns)
    seg = M.Segment.create(4096, "ring")
    try:
        assert seg.path.endswith(".0")
        assert M.remove_stale_segments(only_pids={os.getpid()}) == 1  # judged, though its namespace is unknown
        assert not os.path.exists(seg.path)
    finally:
        seg.close()


def test_the_first_cause_of_a_fallback_is_the_one_reported(tmp_path):
    """Both of the neighbour's segments are gone: mapping its bell fails first, then its ring. The
    report names the first failure (the second usually follows from the same cause)."""
    import json
    store = _Store()
    gone = str(tmp_path / "gone")
    store.set("shm/seg/1", json.dumps({"bell": gone + ".bell", "ring": gone + ".ring", "why": None}))
    store.set("shm/bellok/1", "1")
    store.set("shm/link/0", "0")
    before = set(os.listdir(M.SHM_DIR))
    links = S.ShmLinks(store, 0, 1, 1, True, True, [os.getpid(), os.getpid()], str, 1 << 16, 0.1, 0.0)
    try:
        assert links.fell_back and links.sender is None and links.receiver is None
        assert links.own_problem.startswith("cannot map rank 1's bell"), links.own_problem
        assert links.fallback_reason == links.own_problem
        assert store.kv["shm/bellok/0"] == "0" and store.kv["shm/link/1"] == "0"
    finally:
        links.close()
    assert set(os.listdir(M.SHM_DIR)) <= before  # its own segments are unlinked


def test_a_neighbours_cause_is_not_reported_as_this_ranks_own():
    import json
    store = _Store()
    store.set("shm/seg/1", json.dumps({"bell": None, "ring": None, "why": "cannot reserve 17 MiB in /dev/shm"}))
    store.set("shm/bellok/1", "0")
    store.set("shm/link/0", "0")
    links = S.ShmLinks(store, 0, 1, 1, True, True, [os.getpid(), os.getpid()], str, 1 << 16, 0.1, 0.0)
    try:
        assert links.fell_back
        assert links.fallback_reason == "rank 1: cannot reserve 17 MiB in /dev/shm"
        assert links.own_problem is None
    finally:
        links.close()
