"""Raw-socket data path under the ring: Unix sockets between ranks on one host, TCP between hosts.

gRPC stays the control plane (rendezvous, abort, addresses); only the chunk stream to the right
neighbour moves here, framed as on the gRPC path (``wire``) plus the payload length.

Both ends run in the calling thread, as the shared-memory path does: a sender and a receiver thread per
connection would hand every frame over under the GIL, which costs more than the frame for mid-size
messages:

* send (``SocketSender``): ``sendmsg`` of header, signature, length and the array's own memory (no
  copy), non-blocking; what does not fit in the socket buffer is queued and written by ``pump``, which
  every wait of this rank calls, and by ``drain`` at the end of the collective;
* receive (``SocketReceiver``): the ring's ``take`` reads the next frame from the left neighbour's
  connection straight into a payload buffer that is reused from frame to frame (no allocation, no
  copy), while polling the outbound socket too, so two neighbours sending to each other never block;
* a connection starts with a challenge both ways: the server sends a fresh random nonce, the client
  answers with a hello (magic, rank, ring id, HMAC-SHA256(token, magic + rank + ring id + nonce) and
  a fresh nonce of its own), and the server proves it holds the token too (HMAC-SHA256(token, server
  magic + its rank + ring id + both nonces)) before the client sends any data. The token never crosses
  the socket, a recorded hello or proof cannot be replayed, and a process that is not of the job (one
  that took the port, say) learns nothing; a wrong answer closes the connection (logged once by the
  server; a raised ``RendezvousError`` on the client). An authenticated connection is handed to the
  ring it names; a frame other than the one the ring expects, or larger than ``MAX_FRAME_BYTES``,
  fails the collective; an EOF without the BYE frame reports the peer as lost.

Every wait polls in slices of at most ``SLICE_S``, checking the abort state (peer lost elsewhere,
timeout, mismatch reported over gRPC) and the deadline. Unix sockets live in the abstract namespace
(no file to clean up after a crash) under an unguessable name; the token check keeps other local
users out.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Optional, Tuple

import numpy as np

from ... import config
from ...errors import CollectiveTimeoutError, PeerLostError, RendezvousError
from . import wire
from .outbound import Outbound

log = logging.getLogger("tf_commstrategy")

NONCE_BYTES = 16
#: magic, sender rank, ring id, HMAC-SHA256(token, magic + rank + ring + server nonce), client nonce
HELLO = struct.Struct(f"<8sII32s{NONCE_BYTES}s")
HELLO_MAGIC = b"TFCSSOCK"
PROOF_MAGIC = b"TFCSSRVR"  # the server's answer: HMAC-SHA256(token, this + its rank + ring + client + server nonce)
PROOF_BYTES = 32
HELLO_TIMEOUT_S = 30.0  # a connection must complete its hello within this long, all bytes together
MAX_PENDING_HELLOS = 32  # connections in their hello at once (above: closed at once; the ring needs 2)
SLICE_S = 0.05  # longest poll between checks of the abort state and the deadline
LENGTH = struct.Struct("<Q")
MAX_FRAME_BYTES = 1 << 30  # one ring chunk (TFCS_CHUNK_BYTES, 4 MiB by default) is far smaller


def _hmac(token: Optional[str], magic: bytes, rank: int, ring_id: int, *nonces: bytes) -> bytes:
    """HMAC-SHA256 with the job token over a role's magic, a rank, a ring id and nonces."""
    msg = magic + struct.pack("<II", rank, ring_id) + b"".join(nonces)
    return hmac.new((token or "").encode(), msg, hashlib.sha256).digest()


def _mac(token: Optional[str], rank: int, nonce: bytes, ring_id: int = 0) -> bytes:
    """The client's answer to the server's nonce."""
    return _hmac(token, HELLO_MAGIC, rank, ring_id, nonce)


def _proof(token: Optional[str], server_rank: int, ring_id: int, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The server's answer to the client's nonce (bound to its own)."""
    return _hmac(token, PROOF_MAGIC, server_rank, ring_id, client_nonce, server_nonce)


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> Optional[bytearray]:
    """``n`` bytes, or None when the peer closed first. With a ``deadline`` (``time.monotonic()``), the
    whole read ends by then (``socket.timeout``), however the peer spaces its bytes."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"{got} of {n} bytes by the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return buf


BUFFER_BYTES = 4 << 20  # socket buffers asked for (the kernel doubles them for its bookkeeping)


def _core_max(name: str) -> Optional[int]:
    """The kernel's cap on a socket buffer a process may set (``/proc/sys/net/core/<name>``), or None."""
    try:
        with open(f"/proc/sys/net/core/{name}") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _tune(sock: socket.socket) -> None:
    """TCP_NODELAY, and 4 MiB socket buffers where they help.

    A TCP socket's buffers are set only where the kernel grants the whole size (``wmem_max`` /
    ``rmem_max`` of at least 4 MiB): setting them switches the kernel's autotuning off, which grows a
    connection's buffers up to ``tcp_rmem`` / ``tcp_wmem``'s maximum (6 MiB and 4 MiB by default), and
    a stock kernel caps what a process may set at 208 KiB, a window too small for a fast link. A Unix
    socket has no autotuning: it always gets the largest buffer the kernel allows, up to 4 MiB."""
    tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
    if tcp:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt, cap_name in ((socket.SO_SNDBUF, "wmem_max"), (socket.SO_RCVBUF, "rmem_max")):
        cap = _core_max(cap_name)
        if tcp and (cap is None or cap < BUFFER_BYTES):
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES if cap is None else min(cap, BUFFER_BYTES))
        except OSError:  # pragma: no cover - refused by the kernel
            pass


class SocketServer:
    """Accepts data connections from peers, checks their hello, and keeps each one for the ring it
    names until that ring takes it (``take_connection``)."""

    def __init__(self, rank: int, world_size: int, kind: str, bind_host: str, token: Optional[str], describe_peer):
        self.rank, self.world_size, self.kind = rank, world_size, kind
        self._token, self._describe = token, describe_peer
        self._closing = threading.Event()
        self._bad_logged = False
        self._cv = threading.Condition()
        self._conns = {}  # (ring id, sender rank) -> authenticated socket not yet taken by its ring
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HELLOS)
        if kind == "unix":
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            name = f"\0tfcs-{os.getpid()}-{secrets.token_hex(12)}"
            self._sock.bind(name)
            self.address = "unix:" + name[1:]
        else:
            family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
            self._sock = socket.socket(family, socket.SOCK_STREAM)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self._sock.bind((bind_host, 0))
            except OSError as e:
                raise RendezvousError(f"cannot listen for tcp data connections on {bind_host}: {e}",
                                      rank=rank, address=bind_host, fix="set TFCS_BIND_HOST to an address of "
                                                                        "this host") from None
            self.port = self._sock.getsockname()[1]
            self.address = None  # filled by the backend with the advertised host
        self._sock.listen(world_size + 4)
        self._threads = []
        t = threading.Thread(target=self._accept_loop, name=f"tfcs-{kind}-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def _log_bad(self, what: str) -> None:
        if not self._bad_logged:
            self._bad_logged = True
            log.warning("tf_commstrategy rank %d: rejected a %s data connection (%s); further ones are not "
                        "logged", self.rank, self.kind, what)

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._pending.acquire(blocking=False):  # a flood of unfinished hellos: no thread each
                self._log_bad(f"more than {MAX_PENDING_HELLOS} connections in their hello at once")
                conn.close()
                continue
            t = threading.Thread(target=self._serve_one, args=(conn,), name=f"tfcs-{self.kind}-recv", daemon=True)
            t.start()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            self._pending.release()

    def _serve(self, conn: socket.socket) -> None:
        """Authenticate a new connection, then hand it to the ring it names (``take_connection``)."""
        _tune(conn)
        try:
            nonce = secrets.token_bytes(NONCE_BYTES)
            deadline = time.monotonic() + HELLO_TIMEOUT_S  # a slow or silent client is dropped, not waited for
            conn.settimeout(HELLO_TIMEOUT_S)
            conn.sendall(nonce)
            hello = _recv_exact(conn, HELLO.size, deadline)
            if hello is None:
                conn.close()
                return
            magic, sender, ring_id, mac, theirs = HELLO.unpack(bytes(hello))
            if magic != HELLO_MAGIC or sender >= self.world_size or not hmac.compare_digest(
                    mac, _mac(self._token, sender, nonce, ring_id)):
                self._log_bad("bad hello or job token")
                conn.close()
                return
            conn.sendall(_proof(self._token, self.rank, ring_id, theirs, nonce))  # this server is of the job too
        except OSError:
            conn.close()
            return
        with self._cv:
            if self._closing.is_set():  # stop() already closed the others: this one would be left open
                conn.close()
                return
            old = self._conns.pop((ring_id, sender), None)
            self._conns[(ring_id, sender)] = conn
            self._cv.notify_all()
        if old is not None:  # a newer connection of the same ring and rank replaces it
            old.close()

    def take_connection(self, ring_id: int, sender: int, timeout: float) -> socket.socket:
        """The authenticated connection from rank ``sender`` for ring ``ring_id``, waiting for it.

        Raises:
          RendezvousError: it did not arrive within ``timeout`` seconds.
        """
        end = time.monotonic() + timeout
        with self._cv:
            while (ring_id, sender) not in self._conns:
                left = end - time.monotonic()
                if left <= 0 or self._closing.is_set():
                    raise RendezvousError(
                        f"rank {sender} ({self._describe(sender)}) did not open its {self.kind} data connection to "
                        f"rank {self.rank} within {timeout:g} s", rank=self.rank,
                        fix=f"rank {sender} may have died while starting (see its log); a firewall may block "
                            "the port (TFCS_TRANSPORT=grpc avoids raw sockets)")
                self._cv.wait(min(left, 1.0))
            return self._conns.pop((ring_id, sender))

    def stop(self) -> None:
        self._closing.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._cv:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()
            self._cv.notify_all()


def _views(parts):
    return [memoryview(p).cast("B") for p in parts if len(p)]


def _advance(views, n: int) -> None:
    """Drop the first ``n`` bytes from a list of memoryviews, in place."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if n and views:
        views[0] = views[0][n:]


def _connect(address: str, timeout: float) -> socket.socket:
    if address.startswith("unix:"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout)
            s.connect("\0" + address[len("unix:"):])
        except BaseException:
            s.close()
            raise
    else:
        host, port = address.rsplit(":", 1)
        s = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    s.settimeout(None)
    _tune(s)
    return s


def _lost(my_rank: int, peer_rank: int, who: str, what: str, address: Optional[str] = None) -> PeerLostError:
    return PeerLostError(f"the data connection with rank {peer_rank} ({who}) broke ({what}): the process died, "
                         f"was killed, or the network between the hosts failed", rank=my_rank,
                         peer_rank=peer_rank, peer_address=address, fix=f"look at rank {peer_rank}'s log for the cause")


def _poll_wait(inbound: Optional[socket.socket], outbound, timeout: float) -> None:
    """Sleep until ``inbound`` is readable or ``outbound`` (a stream with queued frames) writable."""
    poller = select.poll()
    if inbound is not None:
        poller.register(inbound.fileno(), select.POLLIN)
    fd = outbound.wait_fd() if outbound is not None else None
    if fd is not None:
        poller.register(fd, select.POLLOUT)
    poller.poll(max(0.0, timeout) * 1000.0)


class SocketSender(Outbound):
    """Frames to the right neighbour over a raw socket, written from the calling thread.

    ``send_frame`` writes what the socket takes without blocking and queues the rest; ``pump`` (called
    from every wait of this rank) and ``drain`` (at the end of each collective) write the queue.
    ``payload`` is sent from its own memory: it must stay unchanged until ``drain`` returns, or until
    the ring's causality guarantees the bytes left (see core/ring.py).
    """

    def __init__(self, sock: socket.socket, peer_rank: int, my_rank: int, who: str, address: Optional[str] = None):
        self.address, self.peer_rank, self.my_rank, self._who = address, peer_rank, my_rank, who
        self._sock = sock
        sock.setblocking(False)
        self._pending: deque = deque()  # memoryview lists of frames not fully written yet, in order
        self._error: Optional[BaseException] = None

    @classmethod
    def connect(cls, address: str, token: Optional[str], peer_rank: int, my_rank: int, timeout: float,
                describe=None, ring_id: int = 0) -> "SocketSender":
        """Open the connection to rank ``peer_rank``'s data server and answer its challenge.

        Raises:
          RendezvousError: the server cannot be reached or hung up before its challenge.
        """
        sock = None
        try:
            sock = _connect(address, timeout)
            sock.settimeout(timeout)
            nonce = _recv_exact(sock, NONCE_BYTES, time.monotonic() + timeout)
            if nonce is None:
                raise RendezvousError(f"the data server of rank {peer_rank} at {address} closed the connection "
                                      f"before its challenge", rank=my_rank, address=address,
                                      fix=f"rank {peer_rank} probably died while starting; see its log")
            mine = secrets.token_bytes(NONCE_BYTES)
            sock.sendall(HELLO.pack(HELLO_MAGIC, my_rank, ring_id, _mac(token, my_rank, bytes(nonce), ring_id), mine))
            proof = _recv_exact(sock, PROOF_BYTES, time.monotonic() + timeout)
            if proof is None or not hmac.compare_digest(bytes(proof), _proof(token, peer_rank, ring_id, mine,
                                                                              bytes(nonce))):
                raise RendezvousError(
                    f"the data server at {address}, which should be rank {peer_rank}'s, "
                    f"{'closed the connection instead of proving' if proof is None else 'did not prove'} that it "
                    f"holds this job's token (expected an HMAC of the job token over both nonces)",
                    rank=my_rank, address=address,
                    fix=f"rank {peer_rank} may have died and its port been taken by another process, or ranks of "
                        "different jobs share a coordinator; restart the job, and use gRPC with TLS on networks "
                        "you do not trust")
        except BaseException as e:
            if sock is not None:
                sock.close()
            if not isinstance(e, OSError):
                raise
            raise RendezvousError(f"cannot open the data connection to rank {peer_rank} at {address}: {e}",
                                  rank=my_rank, address=address,
                                  fix=f"rank {peer_rank} may have died while starting (see its log); ranks that "
                                      "share a hostname but not a network namespace need TFCS_TRANSPORT=grpc "
                                      "or tcp") from None
        return cls(sock, peer_rank, my_rank, describe(peer_rank) if describe is not None else address, address)

    def _fail(self, e: OSError) -> PeerLostError:
        self._error = _lost(self.my_rank, self.peer_rank, self._who, str(e), self.address)
        # A neighbour that failed (or saw another rank fail) reports why over gRPC and then closes its
        # connections: the collective waits a moment for that report before blaming the neighbour.
        self._error.await_report = True
        self._pending.clear()
        return self._error

    def send_frame(self, seq: int, step: int, chunk: int, sig: bytes, payload) -> None:
        if self._error is not None:
            raise self._error
        nbytes = memoryview(payload).nbytes if len(payload) else 0
        head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, seq, step, chunk, self.my_rank, len(sig))
        self._pending.append(_views((head, sig, LENGTH.pack(nbytes), payload)))
        if len(self._pending) == 1:
            self.pump()

    def pump(self) -> bool:
        """Write queued frames as far as the socket takes them; True while some are still queued."""
        while self._pending:
            views = self._pending[0]
            try:
                _advance(views, self._sock.sendmsg(views))
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                raise self._fail(e) from None
            if not views:
                self._pending.popleft()
        return False

    def wait_fd(self) -> Optional[int]:
        """The socket to poll for writability while frames are queued, else None."""
        return self._sock.fileno() if self._pending else None

    def drain(self, timeout: float, abort=None) -> None:
        """Write everything queued (the caller may then reuse the buffers), polling the abort state."""
        end = time.monotonic() + timeout
        while self.pump():
            problem = abort() if abort is not None else None
            if problem is not None:
                raise problem
            left = end - time.monotonic()
            if left <= 0:
                raise CollectiveTimeoutError(
                    f"could not hand data to rank {self.peer_rank} ({self._who}) before the deadline "
                    f"({timeout:g} s left): it stopped reading (stalled or stuck)", rank=self.my_rank,
                    waiting_for=[self.peer_rank],
                    fix=f"rank {self.peer_rank} is stuck; see its log, or raise the deadline (TFCS_TIMEOUT)")
            _poll_wait(None, self, min(left, SLICE_S))
        if self._error is not None:
            raise self._error

    def broken(self) -> Optional[PeerLostError]:
        return self._error

    def close(self, timeout: float = 5.0) -> None:
        try:
            if self._error is None:
                self._pending.append(_views((wire.encode_bye(self.my_rank),)))
                self.drain(timeout)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        finally:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


class SocketReceiver:
    """Frames from the left neighbour, read in the calling thread by ``take`` (same contract as the
    shared-memory receiver: the payload view stays valid until the next ``take``)."""

    def __init__(self, sock: socket.socket, peer_rank: int, my_rank: int, describe, kind: str):
        self._sock, self.peer_rank, self.my_rank, self.kind = sock, peer_rank, my_rank, kind
        self._describe = describe
        sock.setblocking(False)
        self._head = bytearray(wire.HEADER.size)
        self._payload = np.empty(1 << 16, np.uint8)  # grows to the largest frame, then reused
        self._dest = None  # the caller's array the current payload goes to (take(into=)), else None
        self._closed: Optional[BaseException] = None
        self._phase, self._got, self._rest, self._nbytes = 0, 0, b"", 0  # a frame read in part

    def _who(self) -> str:
        return self._describe(self.peer_rank) if self._describe is not None else f"rank {self.peer_rank}"

    def _fill(self, view: memoryview, deadline: float, abort, outbound) -> bool:
        """Read until ``view`` is full, resuming at ``self._got`` (a frame read in part before a
        deadline is continued by the next take); False at the deadline. Raises on EOF / abort."""
        n = len(view)
        while self._got < n:
            try:
                k = self._sock.recv_into(view[self._got:], n - self._got)
            except (BlockingIOError, InterruptedError):
                k = -1
            except OSError as e:
                raise self._broken(str(e), abort) from None
            if k == 0:
                raise self._broken("connection closed", abort)
            if k > 0:
                self._got += k
                continue
            busy = outbound.pump() if outbound is not None else False
            problem = abort() if abort is not None else None
            if problem is not None:
                raise problem
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # an outbound with queued frames and no socket to poll (shared memory) is pumped every 0.5 ms
            pollable = busy and not outbound.wakes_on_space
            _poll_wait(self._sock, outbound if pollable else None,
                       min(left, 0.0005 if busy and not pollable else SLICE_S))
        self._got = 0
        return True

    def _broken(self, what: str, abort) -> BaseException:
        return self._explain(_lost(self.my_rank, self.peer_rank, self._who(), what), abort)

    def _explain(self, err: BaseException, abort) -> BaseException:
        """The neighbour's connection ended: a neighbour that failed itself (or saw another rank fail)
        reports why over gRPC before it goes; wait a moment for that report, so this rank raises the
        real cause rather than blaming the neighbour."""
        self._closed = err
        end = time.monotonic() + config.GONE_GRACE_S
        while abort is not None and time.monotonic() < end:
            problem = abort()
            if problem is not None:
                return problem
            time.sleep(0.01)
        return err

    def take(self, key, deadline: float, sig: bytes, abort=None, outbound=None, into=None):
        """The frame for ``key`` = (seq, step, chunk): (sig, payload uint8 view), or None at the deadline.

        A frame of the same collective under another signature returns (its sig, None); a frame of
        another collective or position returns a description of it as sig, with None (the caller
        reports the mismatch). ``outbound``: this rank's stream to its right neighbour, written while
        waiting. ``into``: a writable uint8 array where a payload of exactly its size is read straight
        from the socket (the view returned is then ``into``), saving the copy out of the reused buffer.
        """
        if self._closed is not None:
            raise self._closed
        if self._phase == 0:  # the fixed header
            if not self._fill(memoryview(self._head), deadline, abort, outbound):
                return None
            magic, version, _, step, _, frm, sig_len = wire.HEADER.unpack(self._head)
            if magic != wire.MAGIC or version != wire.VERSION or frm != self.peer_rank:
                raise self._bad(f"a malformed frame header (magic {magic!r}, version {version}, sender {frm})")
            if step == wire.BYE_STEP:
                raise self._explain(PeerLostError(
                    f"rank {self.peer_rank} ({self._who()}) shut down its process group while rank "
                    f"{self.my_rank} still expected data from it", rank=self.my_rank, peer_rank=self.peer_rank,
                    fix="every rank must make the same collective calls; a rank left early"), abort)
            self._rest = bytearray(sig_len + LENGTH.size)
            self._phase = 1
        if self._phase == 1:  # signature and payload length
            if not self._fill(memoryview(self._rest), deadline, abort, outbound):
                return None
            (self._nbytes,) = LENGTH.unpack_from(self._rest, len(self._rest) - LENGTH.size)
            if self._nbytes > MAX_FRAME_BYTES:
                raise self._bad(f"a frame of {self._nbytes} bytes (limit {MAX_FRAME_BYTES})")
            self._dest = into if into is not None and into.nbytes == self._nbytes else None
            if self._dest is None and self._nbytes > self._payload.nbytes:
                self._payload = np.empty(max(self._nbytes, 2 * self._payload.nbytes), np.uint8)
            self._phase = 2
        view = self._dest if self._dest is not None else self._payload[:self._nbytes]
        if self._nbytes and not self._fill(memoryview(view), deadline, abort, outbound):
            return None
        self._phase = 0
        _, _, seq, step, chunk, _, _ = wire.HEADER.unpack(self._head)
        got_sig = bytes(self._rest[:len(self._rest) - LENGTH.size])
        if (seq, step, chunk) != tuple(key):
            if seq == key[0] and got_sig != sig:
                return got_sig, None
            text = f"frame for collective #{seq} step {step} chunk {chunk} [{got_sig.decode(errors='replace')}]"
            return text.encode(), None
        return got_sig, view

    def _bad(self, what: str) -> BaseException:
        self._closed = PeerLostError(
            f"the {self.kind} data connection from rank {self.peer_rank} ({self._who()}) sent {what}; it is "
            f"closed", rank=self.my_rank, peer_rank=self.peer_rank,
            fix="both ranks must run the same tf_commstrategy version; report this as a bug otherwise")
        return self._closed

    def release(self) -> None:
        """Nothing to give back: the payload buffer is reused by the next ``take``."""

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


def choose(requested: str, same_host: bool, same_memory: bool = False, tls: bool = False) -> str:
    """Data path between two ring neighbours.

    "auto": shared memory when they share a host's memory (same host and namespaces), else unix
    sockets on one host, else raw TCP between hosts, or gRPC when the job has TLS (gRPC carries it;
    raw TCP proves the token but does not encrypt). "shm" and "unix" degrade the same way; "tcp" and
    "grpc" are kept. A raw TCP link chosen here falls back to gRPC when it cannot be opened
    (``links.RingLinks``); one asked for ("tcp") does not.
    """
    if requested in ("auto", "shm", "unix"):
        if same_memory and requested != "unix":
            return "shm"
        if same_host:
            return "unix"
        return "grpc" if tls else "tcp"
    return requested


def split(address: str) -> Tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)
