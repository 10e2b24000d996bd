"""Raw-socket data path under the ring: Unix sockets between ranks on one host, opt-in TCP between hosts.

gRPC stays the control plane (rendezvous, abort, addresses); only the chunk stream to the right
neighbour moves here, framed exactly as on the gRPC path (``wire``), into the same ``Mailbox``.

* send: ``sendmsg`` of header, signature and the array's own memory (no copy) from one sender thread
  per stream, so the ring's "send a segment, then receive" never blocks on a full socket buffer;
* receive: one thread per incoming connection reads the header, then ``recv_into`` a fresh buffer that
  the mailbox hands to the ring without another copy;
* a connection starts with a challenge: the server sends a fresh random nonce, the client answers
  with a hello (magic, rank, HMAC-SHA256(token, magic + rank + nonce)), so the token never crosses
  the socket and a recorded hello cannot be replayed; a wrong answer or a malformed frame closes
  the connection, logged once; an EOF without the BYE frame reports the peer as lost.

Unix sockets live in the abstract namespace (no file to clean up after a crash) under an
unguessable name; the token check keeps other local users out.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from typing import Optional, Tuple

import numpy as np

from ...errors import CollectiveTimeoutError, PeerLostError, RendezvousError
from . import wire

log = logging.getLogger("tf_commstrategy")

HELLO = struct.Struct("<8sI32s")  # magic, sender rank, HMAC-SHA256(token, magic + rank + nonce)
HELLO_MAGIC = b"TFCSSOCK"
NONCE_BYTES = 16
_CLOSE = object()
HELLO_TIMEOUT_S = 30.0
MAX_FRAME_BYTES = 1 << 30  # one ring chunk (TFCS_CHUNK_BYTES, 4 MiB by default) is far smaller


def _mac(token: Optional[str], rank: int, nonce: bytes) -> bytes:
    key = (token or "").encode()
    return hmac.new(key, HELLO_MAGIC + struct.pack("<I", rank) + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> Optional[bytearray]:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return buf


def _tune(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:  # pragma: no cover - capped by the kernel
            pass


class SocketServer:
    """Accepts data connections from peers and feeds their frames into the mailbox."""

    def __init__(self, rank: int, world_size: int, kind: str, bind_host: str, token: Optional[str],
                 mailbox: wire.Mailbox, describe_peer):
        self.rank, self.world_size, self.kind = rank, world_size, kind
        self._token, self._mailbox, self._describe = token, mailbox, describe_peer
        self._closing = threading.Event()
        self._bad_logged = False
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
            t = threading.Thread(target=self._serve, args=(conn,), name=f"tfcs-{self.kind}-recv", daemon=True)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        _tune(conn)
        sender = None
        try:
            nonce = secrets.token_bytes(NONCE_BYTES)
            conn.settimeout(HELLO_TIMEOUT_S)  # a silent client is dropped, not waited for
            conn.sendall(nonce)
            hello = _recv_exact(conn, HELLO.size)
            if hello is None:
                return
            conn.settimeout(None)
            magic, sender, mac = HELLO.unpack(bytes(hello))
            if magic != HELLO_MAGIC or sender >= self.world_size or not hmac.compare_digest(
                    mac, _mac(self._token, sender, nonce)):
                self._log_bad("bad hello or job token")
                sender = None
                return
            while True:
                head = _recv_exact(conn, wire.HEADER.size)
                if head is None:
                    break
                magic, version, seq, step, chunk, frm, sig_len = wire.HEADER.unpack(bytes(head))
                if magic != wire.MAGIC or version != wire.VERSION or frm != sender:
                    self._log_bad("malformed frame header")
                    sender = None
                    break
                if step == wire.BYE_STEP:
                    self._mailbox.peer_gone(sender, PeerLostError(
                        f"rank {sender} ({self._describe(sender)}) shut down its process group while rank "
                        f"{self.rank} still expected data from it", rank=self.rank, peer_rank=sender,
                        fix="every rank must make the same collective calls; a rank left early"))
                    return
                sig_and_len = _recv_exact(conn, sig_len + 8)
                if sig_and_len is None:
                    break
                sig = bytes(sig_and_len[:sig_len])
                (nbytes,) = struct.unpack("<Q", sig_and_len[sig_len:])
                if nbytes > MAX_FRAME_BYTES:
                    self._log_bad(f"frame of {nbytes} bytes (limit {MAX_FRAME_BYTES})")
                    sender = None
                    break
                payload = np.empty(nbytes, dtype=np.uint8)
                view = memoryview(payload)
                got = 0
                while got < nbytes:
                    k = conn.recv_into(view[got:], nbytes - got)
                    if k == 0:
                        break
                    got += k
                if got < nbytes:
                    break
                if not self._mailbox.deposit((seq, step, chunk), sig, view):
                    self._log_bad(f"frame for collective #{seq}, which is not running here")
                    sender = None  # not a lost peer: a rejected connection
                    break
        except OSError:
            pass
        finally:
            conn.close()
            if sender is not None and not self._closing.is_set():
                self._mailbox.peer_gone(sender, PeerLostError(
                    f"the {self.kind} data connection from rank {sender} ({self._describe(sender)}) broke: the "
                    f"process died, was killed, or the network between the hosts failed", rank=self.rank,
                    peer_rank=sender, fix=f"look at rank {sender}'s log for the cause"))

    def stop(self) -> None:
        self._closing.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


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
        s.settimeout(timeout)
        s.connect("\0" + address[len("unix:"):])
    else:
        host, port = address.rsplit(":", 1)
        s = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    s.settimeout(None)
    _tune(s)
    return s


class SocketStream:
    """Frames to one peer over a raw socket, sent by a background thread (same interface as PeerStream)."""

    def __init__(self, address: str, token: Optional[str], peer_rank: int, my_rank: int, timeout: float,
                 describe=None):
        self.address, self.peer_rank, self.my_rank = address, peer_rank, my_rank
        self._who = describe(peer_rank) if describe is not None else address
        try:
            self._sock = _connect(address, timeout)
            self._sock.settimeout(timeout)
            nonce = _recv_exact(self._sock, NONCE_BYTES)
        except OSError as e:
            raise RendezvousError(f"cannot open the data connection to rank {peer_rank} at {address}: {e}",
                                  rank=my_rank, address=address,
                                  fix=f"rank {peer_rank} may have died while starting (see its log); ranks that "
                                      "share a hostname but not a network namespace need TFCS_TRANSPORT=grpc "
                                      "or tcp") from None
        if nonce is None:
            raise RendezvousError(f"the data server of rank {peer_rank} at {address} closed the connection "
                                  f"before its challenge", rank=my_rank, address=address,
                                  fix=f"rank {peer_rank} probably died while starting; see its log")
        self._sock.settimeout(None)
        self._sock.sendall(HELLO.pack(HELLO_MAGIC, my_rank, _mac(token, my_rank, bytes(nonce))))
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tfcs-socket-send", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            try:
                if self._error is None:
                    self._send_parts(item if isinstance(item, list) else _views(item))
            except OSError as e:
                self._error = PeerLostError(
                    f"the data connection to rank {self.peer_rank} ({self._who}) broke ({e})",
                    rank=self.my_rank, peer_rank=self.peer_rank, peer_address=self.address,
                    fix=f"rank {self.peer_rank} probably died; see its log")
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()

    def _send_parts(self, views) -> None:
        while views:
            _advance(views, self._sock.sendmsg(views))

    def send_frame(self, seq: int, step: int, chunk: int, sig: bytes, payload) -> None:
        """Queue one frame; ``payload`` is sent from its own memory (it must stay unchanged until
        ``drain`` returns or the ring's causality guarantees the bytes left, see core/ring.py)."""
        if self._error is not None:
            raise self._error
        nbytes = memoryview(payload).nbytes if len(payload) else 0
        head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, seq, step, chunk, self.my_rank, len(sig))
        views = _views((head, sig, struct.pack("<Q", nbytes), payload))
        with self._lock:
            if self._pending == 0:
                # Nothing queued: try to send right here, without blocking (saves a thread hand-off).
                try:
                    _advance(views, self._sock.sendmsg(views, (), socket.MSG_DONTWAIT))
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as e:
                    self._error = PeerLostError(
                        f"the data connection to rank {self.peer_rank} ({self._who}) broke ({e})",
                        rank=self.my_rank, peer_rank=self.peer_rank, peer_address=self.address,
                        fix=f"rank {self.peer_rank} probably died; see its log")
                    raise self._error from None
                if not views:
                    return
            self._pending += 1
            self._idle.clear()
        self._queue.put(views)  # the rest goes out from the sender thread, in order

    def drain(self, timeout: float, abort=None) -> None:
        """Wait until everything queued is on the wire (the caller may then reuse the buffers).

        ``abort()``, polled while waiting, may return an error to raise instead (peer lost elsewhere).
        """
        end = time.monotonic() + timeout
        while not self._idle.wait(min(0.2, max(0.0, end - time.monotonic()))):
            problem = abort() if abort is not None else None
            if problem is not None:
                raise problem
            if time.monotonic() >= end:
                break
        if not self._idle.is_set():
            raise CollectiveTimeoutError(
                f"could not hand data to rank {self.peer_rank} ({self._who}) before the deadline "
                f"({timeout:g} s left): it stopped reading (stalled or stuck)", rank=self.my_rank,
                waiting_for=[self.peer_rank],
                fix=f"rank {self.peer_rank} is stuck; see its log, or raise the deadline (TFCS_TIMEOUT)")
        if self._error is not None:
            raise self._error

    def broken(self) -> Optional[PeerLostError]:
        return self._error

    def close(self, timeout: float = 5.0) -> None:
        try:
            if self._error is None:
                self._queue.put((wire.encode_bye(self.my_rank),))
                with self._lock:
                    self._pending += 1
                    self._idle.clear()
                self._idle.wait(timeout)
        finally:
            self._queue.put(_CLOSE)
            self._thread.join(timeout)
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


def parse_transport(name: Optional[str]) -> str:
    from ...errors import ConfigurationError
    n = (name or "auto").strip().lower()
    if n not in ("auto", "grpc", "tcp", "unix", "shm"):
        raise ConfigurationError(f"unknown transport {name!r}", fix="use auto, shm, unix, tcp or grpc")
    return n


def choose(requested: str, same_host: bool, same_memory: bool = False) -> str:
    """Data path between two ring neighbours.

    "auto": shared memory when they share a host's memory (same host and namespaces), else unix
    sockets on one host, else grpc. "shm" and "unix" degrade the same way; "tcp" and "grpc" are kept.
    """
    if requested in ("auto", "shm"):
        if same_memory:
            return "shm"
        return "unix" if same_host else "grpc"
    if requested == "unix" and not same_host:
        return "grpc"
    return requested


def split(address: str) -> Tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)
