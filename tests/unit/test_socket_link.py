"""The inline raw-socket link (SocketSender / SocketReceiver) over a socket pair, in one thread."""

import socket
import time

import numpy as np
import pytest

from tf_commstrategy import config
from tf_commstrategy.backends.host import socket_transport as S
from tf_commstrategy.errors import PeerLostError


def _pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (a, b):  # small kernel buffers: large frames must be queued and pumped
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    return a, b


def _ends():
    """Rank 0 and rank 1 each with a sender to the other and a receiver from the other."""
    a01, b01 = _pair()  # 0 -> 1
    a10, b10 = _pair()  # 1 -> 0
    tx0, rx1 = S.SocketSender(a01, 1, 0, "rank 1"), S.SocketReceiver(b01, 0, 1, None, "unix")
    tx1, rx0 = S.SocketSender(a10, 0, 1, "rank 0"), S.SocketReceiver(b10, 1, 0, None, "unix")
    return (tx0, rx0), (tx1, rx1)


def test_two_neighbours_exchange_frames_larger_than_the_socket_buffers_from_one_thread():
    (tx0, rx0), (tx1, rx1) = _ends()
    rng = np.random.default_rng(0)
    big0 = rng.integers(0, 255, 3 << 20, dtype=np.uint8)
    big1 = rng.integers(0, 255, 3 << 20, dtype=np.uint8)
    # both send first (neither send can complete alone), then both receive: the waits pump the sends
    tx0.send_frame(7, 0, 0, b"sig", big0)
    tx1.send_frame(7, 0, 0, b"sig", big1)
    assert tx0.wait_fd() is not None  # queued: the pair's buffers are far smaller than 3 MiB
    # one thread plays both ranks: alternate short takes until both frames are in
    got = {}
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        for name, rx, out in (("0", rx0, tx0), ("1", rx1, tx1)):
            if name in got:
                out.pump()
                continue
            item = rx.take((7, 0, 0), time.monotonic() + 0.01, b"sig", outbound=out)
            if item is not None:
                got[name] = bytes(item[1])
    assert got["1"] == big0.tobytes() and got["0"] == big1.tobytes()
    tx0.drain(5)
    tx1.drain(5)
    assert tx0.wait_fd() is None and tx1.wait_fd() is None


def test_frames_come_in_order_with_their_signature_and_keys():
    (tx0, _), (_, rx1) = _ends()
    for i in range(50):
        tx0.send_frame(i, 1, i % 3, f"sig{i}".encode(), np.full(1000 + i, i % 251, np.uint8))
    tx0.drain(5)
    for i in range(50):
        sig, view = rx1.take((i, 1, i % 3), time.monotonic() + 5, f"sig{i}".encode())
        assert sig == f"sig{i}".encode() and view.nbytes == 1000 + i and (view == i % 251).all()


def test_a_payload_of_the_destinations_size_is_read_straight_into_it():
    (tx0, _), (_, rx1) = _ends()
    big = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)  # larger than the socket buffers
    tx0.send_frame(1, 0, 0, b"s", big)
    tx0.send_frame(1, 0, 1, b"s", big[:100])
    dst = np.zeros(big.size, np.uint8)
    got = None
    deadline = time.monotonic() + 10
    while got is None:  # one thread plays both ends: pump the sender while the receiver waits
        tx0.pump()
        got = rx1.take((1, 0, 0), min(deadline, time.monotonic() + 0.01), b"s", into=dst)
        assert time.monotonic() < deadline
    sig, view = got
    assert view is dst and np.array_equal(dst, big)  # no copy out of the reused buffer
    wrong_size = np.zeros(50, np.uint8)  # not the payload's size: the reused buffer, untouched dst
    sig, view = rx1.take((1, 0, 1), time.monotonic() + 5, b"s", into=wrong_size)
    assert view is not wrong_size and np.array_equal(view, big[:100]) and not wrong_size.any()


def test_another_key_or_signature_is_reported_not_returned_as_data():
    (tx0, _), (_, rx1) = _ends()
    tx0.send_frame(3, 0, 0, b"theirs", np.zeros(8, np.uint8))
    tx0.send_frame(4, 0, 0, b"mine", np.zeros(8, np.uint8))
    sig, view = rx1.take((3, 0, 0), time.monotonic() + 5, b"mine")
    assert sig == b"theirs" and view is not None  # the expected key: the caller compares the signatures
    sig, view = rx1.take((5, 0, 0), time.monotonic() + 5, b"mine")
    assert view is None and b"collective #4" in sig


def test_the_deadline_returns_none_and_bye_or_eof_raise_peer_lost():
    (tx0, _), (_, rx1) = _ends()
    t0 = time.monotonic()
    assert rx1.take((0, 0, 0), time.monotonic() + 0.2, b"s") is None
    assert 0.15 < time.monotonic() - t0 < 2.0
    tx0.close()  # sends BYE
    with pytest.raises(PeerLostError, match="shut down its process group"):
        rx1.take((0, 0, 0), time.monotonic() + 5, b"s")
    (tx0, _), (_, rx1) = _ends()
    tx0._sock.close()  # dies without BYE
    with pytest.raises(PeerLostError, match="broke"):
        rx1.take((0, 0, 0), time.monotonic() + 5, b"s")


def test_an_abort_reported_elsewhere_wins_over_the_closed_connection():
    (tx0, _), (_, rx1) = _ends()
    tx0.close()
    real = PeerLostError("rank 2 is gone", rank=1, peer_rank=2)
    with pytest.raises(PeerLostError, match="rank 2 is gone"):
        rx1.take((0, 0, 0), time.monotonic() + 5, b"s", abort=lambda: real)


def test_oversized_frames_are_refused():
    (tx0, _), (_, rx1) = _ends()
    head = S.wire.HEADER.pack(S.wire.MAGIC, S.wire.VERSION, 0, 0, 0, 0, 1)
    tx0._sock.setblocking(True)
    tx0._sock.sendall(head + b"s" + S.LENGTH.pack(S.MAX_FRAME_BYTES + 1))
    with pytest.raises(PeerLostError, match="limit"):
        rx1.take((0, 0, 0), time.monotonic() + 5, b"s")


def test_a_broken_outbound_waits_for_the_failure_another_rank_reports(monkeypatch):
    """A neighbour that saw another rank die reports it over gRPC, then closes its connections: the
    rank whose send then fails must raise the reported cause, not blame that neighbour."""
    import threading

    from types import SimpleNamespace

    from tf_commstrategy.backends.host import runner as R
    from tf_commstrategy.backends.host import wire
    b = SimpleNamespace(rank=0, size=3, mailbox=wire.Mailbox())  # only the mailbox is needed here
    (tx0, _), (_, rx1) = _ends()
    rx1._sock.close()  # the neighbour (rank 1) went away
    with pytest.raises(PeerLostError) as e:
        tx0.send_frame(0, 0, 0, b"s", np.zeros(1 << 20, np.uint8))
        tx0.drain(5)
    assert getattr(e.value, "await_report", False) and e.value.peer_rank == 1
    real = PeerLostError("rank 2 was lost (reported by rank 1)", rank=0, peer_rank=2)
    threading.Timer(0.1, lambda: b.mailbox.fail(real, remote=True)).start()
    with monkeypatch.context() as m:  # a report 0.1 s later is waited for (a long grace: no CPU race)
        m.setattr(config, "GONE_GRACE_S", 5.0)
        assert R.CollectiveRunner(b).reported_cause(e.value) is real
    # nobody reports: the neighbour is blamed once the grace has passed (a fake clock: no real wait)
    now = [100.0]
    monkeypatch.setattr(R.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(R.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    quiet = SimpleNamespace(rank=0, size=3, mailbox=wire.Mailbox())
    assert R.CollectiveRunner(quiet).reported_cause(e.value) is e.value
    assert now[0] >= 100.0 + config.GONE_GRACE_S


@pytest.mark.parametrize("server", ["hangs-up", "absent"])
def test_a_failed_connect_closes_its_socket(server, monkeypatch):
    import threading
    from tf_commstrategy.errors import RendezvousError
    name = f"tfcs-test-{time.monotonic_ns()}"
    lst = None
    if server == "hangs-up":  # accepts, then closes before sending its challenge
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lst.bind("\0" + name)
        lst.listen(16)

        def hang_up():
            for _ in range(20):
                conn, _ = lst.accept()
                conn.close()
        threading.Thread(target=hang_up, daemon=True).start()
    made = []  # every socket the connects create
    init = socket.socket.__init__

    def recording_init(self, *a, **k):
        init(self, *a, **k)
        made.append(self)
    monkeypatch.setattr(socket.socket, "__init__", recording_init)
    kept = []  # the errors are kept, as a caller that reports them later does: their frames stay alive
    for _ in range(20):
        with pytest.raises(RendezvousError) as e:
            S.SocketSender.connect(f"unix:{name}", None, 1, 0, timeout=5)
        kept.append(e.value)
    monkeypatch.undo()
    mine = [x for x in made if x is not lst]
    assert len(mine) >= 20 and all(x.fileno() == -1 for x in mine)  # every one closed
    if lst is not None:
        lst.close()


def test_a_calls_transport_is_judged_from_job_wide_facts_only():
    """CommOptions(transport=) on a call: every rank must give the same verdict, whatever its own links
    are (2 hosts x 2 ranks under "auto": ranks 0 and 2 send over shm, ranks 1 and 3 over grpc)."""
    from types import SimpleNamespace
    from tf_commstrategy.backends.host.backend import HostBackend
    from tf_commstrategy.errors import ConfigurationError

    def verdict(requested, planned, own, wanted):
        b = SimpleNamespace(group=SimpleNamespace(transport=requested),
                            layout=SimpleNamespace(planned_kinds=frozenset(planned), transport=own))
        return HostBackend.serves_transport(b, wanted)
    mixed = ["shm", "grpc", "shm", "grpc"]
    for own in ("shm", "grpc"):  # the same answer on both kinds of rank
        assert verdict("auto", mixed, own, "shm") is False
        assert verdict("auto", mixed, own, "grpc") is False
        assert verdict("auto", mixed, own, "auto") is True
        assert verdict("auto", mixed, own, " AUTO") is True
    assert verdict("auto", ["shm", "shm"], "shm", "SHM") is True  # one host: every link is shm
    assert verdict("tcp", ["tcp", "tcp"], "tcp", "tcp") is True
    assert verdict("Tcp", ["tcp", "tcp"], "tcp", "tcp") is True
    assert verdict("tcp", ["tcp", "tcp"], "tcp", "unix") is False
    with pytest.raises(ConfigurationError, match="unknown transport"):
        verdict("auto", mixed, "shm", "rdma")


def _connect_unix(address):
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect("\0" + address[len("unix:"):])
    c.settimeout(10)
    return c


def test_a_hello_must_complete_within_its_deadline_however_its_bytes_are_spaced(monkeypatch):
    """A client that sends its hello one byte at a time, each within the per-read timeout, is still
    dropped once HELLO_TIMEOUT_S has passed in all (it would otherwise hold a thread for minutes)."""
    monkeypatch.setattr(S, "HELLO_TIMEOUT_S", 0.6)
    srv = S.SocketServer(0, 2, "unix", None, "token", str)
    try:
        c = _connect_unix(srv.address)
        assert len(c.recv(S.NONCE_BYTES)) == S.NONCE_BYTES
        t0 = time.monotonic()
        dropped = None
        for _ in range(S.HELLO.size - 1):  # never the whole hello
            time.sleep(0.1)
            try:
                c.send(b"x")
            except OSError:
                dropped = time.monotonic() - t0
                break
            c.setblocking(False)
            try:
                if c.recv(1) == b"":
                    dropped = time.monotonic() - t0
                    break
            except BlockingIOError:
                pass
            finally:
                c.setblocking(True)
        assert dropped is not None and dropped < 2.0, dropped  # 0.6 s deadline, not 0.6 s per byte
        c.close()
    finally:
        srv.stop()


def test_connections_beyond_the_pending_hello_cap_are_closed_at_once(monkeypatch):
    monkeypatch.setattr(S, "MAX_PENDING_HELLOS", 2)
    srv = S.SocketServer(0, 2, "unix", None, "token", str)
    try:
        silent = [_connect_unix(srv.address) for _ in range(2)]  # each holds a hello slot
        for c in silent:
            assert len(c.recv(S.NONCE_BYTES)) == S.NONCE_BYTES
        extra = _connect_unix(srv.address)
        assert extra.recv(S.NONCE_BYTES) == b""  # closed without a challenge: no thread for it
        for c in silent + [extra]:
            c.close()
        time.sleep(0.3)  # the silent ones' slots come back when they hang up
        again = _connect_unix(srv.address)
        assert len(again.recv(S.NONCE_BYTES)) == S.NONCE_BYTES
        again.close()
    finally:
        srv.stop()


def _impostor(name, answer):
    """A Unix-socket server that is not of the job: it challenges, reads the hello, then ``answer``s."""
    import threading
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind("\0" + name)
    lst.listen(4)
    seen = []

    def serve():
        conn, _ = lst.accept()
        with conn:
            conn.settimeout(5)
            conn.sendall(b"n" * S.NONCE_BYTES)
            hello = S._recv_exact(conn, S.HELLO.size)
            seen.append(hello)
            if answer == "garbage":
                conn.sendall(b"p" * S.PROOF_BYTES)
            if answer != "hang-up":
                try:
                    seen.append(conn.recv(1))  # anything sent after the handshake: b"" if the client hung up
                except OSError:
                    seen.append(b"")
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lst, t, seen


@pytest.mark.parametrize("answer", ["garbage", "hang-up"])
def test_a_client_sends_nothing_to_a_server_that_cannot_prove_it_holds_the_job_token(answer):
    """A process that took the port (a neighbour died, say) must not receive the job's data."""
    from tf_commstrategy.errors import RendezvousError
    name = f"tfcs-test-{time.monotonic_ns()}"
    lst, t, seen = _impostor(name, answer)
    try:
        with pytest.raises(RendezvousError, match="holds this job's token") as e:
            S.SocketSender.connect(f"unix:{name}", "token", 1, 0, timeout=5)
        assert ("did not prove" if answer == "garbage" else "closed the connection instead") in str(e.value)
        t.join(10)
        assert seen[0] is not None and len(seen[0]) == S.HELLO.size
        if answer == "garbage":
            assert seen[1] == b""  # the client hung up without sending a frame
    finally:
        lst.close()


def test_the_servers_proof_names_its_rank_and_ring():
    """The proof of rank 0's server does not pass for rank 1's, nor for another ring's, nor another job's."""
    srv = S.SocketServer(0, 3, "unix", None, "token", str)
    try:
        from tf_commstrategy.errors import RendezvousError
        ok = S.SocketSender.connect(srv.address, "token", 0, 2, timeout=5, ring_id=1)
        ok._sock.close()
        with pytest.raises(RendezvousError, match="did not prove"):
            S.SocketSender.connect(srv.address, "token", 1, 2, timeout=5)  # expects rank 1 behind the address
        assert S._proof("token", 0, 1, b"c" * 16, b"s" * 16) != S._proof("token", 0, 2, b"c" * 16, b"s" * 16)
        assert S._proof("token", 0, 1, b"c" * 16, b"s" * 16) != S._proof("other", 0, 1, b"c" * 16, b"s" * 16)
    finally:
        srv.stop()


@pytest.mark.parametrize("cap,fixed", [(212992, False), (4 << 20, True), (None, False)])
def test_tcp_buffers_are_fixed_only_where_the_kernel_grants_the_whole_size(monkeypatch, cap, fixed):
    """A stock kernel caps a socket buffer a process sets at 208 KiB, and setting one switches TCP's
    autotuning off: the buffers are then left to the kernel (they keep their initial sizes here)."""
    monkeypatch.setattr(S, "_core_max", lambda name: cap)
    plain = socket.socket()
    want_snd, want_rcv = (plain.getsockopt(socket.SOL_SOCKET, o) for o in (socket.SO_SNDBUF, socket.SO_RCVBUF))
    plain.close()
    s = socket.socket()
    try:
        S._tune(s)
        got = tuple(s.getsockopt(socket.SOL_SOCKET, o) for o in (socket.SO_SNDBUF, socket.SO_RCVBUF))
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        s.close()
    if fixed:  # the kernel doubles what is set (capped by the real rmem_max/wmem_max of this machine)
        assert got[0] > want_snd and got[1] > want_rcv
    else:
        assert got == (want_snd, want_rcv)


def test_unix_sockets_get_the_largest_buffer_the_kernel_allows(monkeypatch):
    real = S._core_max("wmem_max")
    if real is None or real < 64 << 10:
        pytest.skip(f"this kernel's wmem_max ({real}) is below what the test sets")
    monkeypatch.setattr(S, "_core_max", lambda name: 64 << 10)  # a cap below the 4 MiB asked for
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        S._tune(a)
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 128 << 10  # the cap, doubled
    finally:
        a.close()
        b.close()


def test_the_data_path_of_a_pair_of_ranks():
    from tf_commstrategy.backends.host.socket_transport import choose
    for requested in ("auto", "shm"):
        assert choose(requested, same_host=True, same_memory=True) == "shm"
        assert choose(requested, same_host=True, same_memory=False) == "unix"
        assert choose(requested, same_host=False) == "tcp"  # raw TCP between hosts by default
        assert choose(requested, same_host=False, tls=True) == "grpc"  # gRPC carries TLS
    assert choose("unix", same_host=True, same_memory=True) == "unix"
    assert choose("unix", same_host=False) == "tcp" and choose("unix", same_host=False, tls=True) == "grpc"
    for kept in ("tcp", "grpc"):  # asked for: on every link, same-host ones too
        assert choose(kept, same_host=True, same_memory=True) == kept
        assert choose(kept, same_host=False, tls=True) == kept
