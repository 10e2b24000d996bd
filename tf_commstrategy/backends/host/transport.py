"""gRPC data path of the ring: a data server per rank and one persistent stream to the right peer.

* ``DataServer`` (service ``tfcs.Data``): ``Send`` is a client-streaming method; each incoming
  message is framed by ``wire`` and dropped into the ``Mailbox`` without copying its payload.
  A stream that ends without the BYE message means the sender died: the mailbox learns that the
  peer is lost, so a rank waiting for it fails within seconds (gRPC keepalive bounds a silent
  partition), not at the deadline. ``Abort`` lets a failing rank poison everybody's mailbox; it
  names the error kind, so a lost peer is reported as ``PeerLostError`` for that peer everywhere.
  ``Ping`` answers heartbeats (``liveness``) with this rank's collective progress.
* ``PeerStream``: one long-lived ``Send`` call to a peer, fed from a queue by gRPC's own
  request-consumer thread, so ``send`` returns as soon as the bytes are framed.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Callable, Optional

import grpc

from ...core import grpc_util
from ...errors import CollectiveAbortedError, CollectiveMismatchError, CollectiveTimeoutError, PeerLostError
from . import wire
from .outbound import Outbound

log = logging.getLogger("tf_commstrategy")
SERVICE = "Data"


class DataServer:
    def __init__(self, rank: int, world_size: int, bind: str, token: Optional[str],
                 mailbox: wire.Mailbox, describe_peer: Callable[[int], str],
                 progress: Optional[Callable[[], dict]] = None, tls=None):
        self.rank = rank
        self.world_size = world_size
        self.mailbox = mailbox
        self._describe = describe_peer
        self._progress = progress or (lambda: {})
        self._closing = threading.Event()
        self._bad_logged = False
        handlers = {"Send": ("stream", self._send), "Abort": ("unary", self._abort), "Ping": ("unary", self._ping)}
        self._server, self.port = grpc_util.start_server(SERVICE, handlers, bind, token,
                                                         max_workers=world_size + 8, tls=tls)

    def _log_bad(self, what: str) -> None:
        if not self._bad_logged:
            self._bad_logged = True
            log.warning("tf_commstrategy rank %d: rejected a malformed data message (%s); "
                        "further ones are not logged", self.rank, what)

    def _send(self, request_iterator, context):
        # The sender names itself in the call metadata, so a peer that dies before its first message
        # is still known (and reported) when its stream breaks.
        sender = None
        for key, value in context.invocation_metadata() or ():
            if key == RANK_METADATA_KEY:
                try:
                    sender = int(value) if 0 <= int(value) < self.world_size else None
                except ValueError:
                    sender = None
        problem = None
        try:
            for msg in request_iterator:
                try:
                    seq, step, chunk, frm, sig, payload = wire.decode(msg, self.world_size)
                except wire.MalformedMessage as e:
                    problem = f"malformed data message: {e}"
                    break
                if sender is not None and frm != sender:
                    problem = f"frame from rank {frm} on the stream of rank {sender}"
                    break
                sender = frm
                if step == wire.BYE_STEP:
                    self.mailbox.peer_gone(sender, PeerLostError(
                        f"rank {sender} ({self._describe(sender)}) shut down its process group while "
                        f"rank {self.rank} still expected data from it",
                        rank=self.rank, peer_rank=sender, peer_address=self._describe(sender),
                        fix="every rank must make the same collective calls; a rank left early"))
                    return b""
                if not self.mailbox.deposit((seq, step, chunk), sig, payload):
                    problem = f"frame for collective #{seq}, which is not running here"
                    break
        except grpc.RpcError:
            pass
        except Exception as e:  # pragma: no cover - a handler must never die silently
            log.exception("tf_commstrategy rank %d: data stream handler failed: %s", self.rank, e)
        if problem is not None:
            # A rejected stream is not the peer's real stream: it does not count as a lost peer.
            self._log_bad(problem)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if sender is not None and not self._closing.is_set():
            self.mailbox.peer_gone(sender, PeerLostError(
                f"the connection from rank {sender} ({self._describe(sender)}) broke: the process died, "
                f"was killed, or the network between the hosts failed",
                rank=self.rank, peer_rank=sender, peer_address=self._describe(sender),
                fix=f"look at rank {sender}'s log for the cause; restart the job (tfcs-run --max-restarts)"))
        return b""

    def _abort(self, request, context):
        try:
            r = json.loads(request)
            origin, message = int(r["origin"]), str(r["message"])
            kind, peer, seq = str(r.get("kind", "")), r.get("peer"), r.get("seq")
            peer = int(peer) if peer is not None else None
            seq = int(seq) if seq is not None else None
            waiting = [int(x) for x in r.get("waiting_for") or ()]
            if not 0 <= origin < self.world_size or any(not 0 <= x < self.world_size for x in
                                                        waiting + ([peer] if peer is not None else [])):
                raise ValueError("rank out of range")
        except (ValueError, KeyError, TypeError, AttributeError):
            self._log_bad("bad abort request")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed abort request")
            return b""
        self.mailbox.fail(remote_error(self.rank, origin, kind, message, peer, seq, waiting, self._describe),
                          remote=True)
        return b"{}"

    def _ping(self, request, context):
        return json.dumps(dict(self._progress(), rank=self.rank)).encode()

    def stop(self, grace: float = 0.5) -> None:
        self._closing.set()
        self._server.stop(grace).wait(grace + 1.0)


def remote_error(rank: int, origin: int, kind: str, message: str, peer: Optional[int], seq: Optional[int],
                 waiting_for, describe: Callable[[int], str]):
    """The error this rank raises when rank ``origin`` reports its own: the same class for the
    failures every rank shares (a lost peer, a timeout, a mismatch), else CollectiveAbortedError."""
    seen = f"reported by rank {origin}: {message}"
    which = f"collective #{seq}" if seq is not None else "a collective"  # a layer's own (compiled) has none
    if kind == "PeerLostError" and peer is not None and peer != rank:
        return PeerLostError(f"rank {peer} ({describe(peer)}) was lost ({seen})", rank=rank, seq=seq,
                             peer_rank=peer, peer_address=describe(peer),
                             fix=f"look at rank {peer}'s host and log; restart the job (tfcs-run --max-restarts)")
    if kind == "CollectiveTimeoutError":
        names = ", ".join(f"rank {w} ({describe(w)})" for w in waiting_for) or "?"
        return CollectiveTimeoutError(f"{which} timed out; not arrived: {names} ({seen})", rank=rank,
                                      seq=seq, waiting_for=waiting_for,
                                      fix="see the not-arrived ranks' logs; they are stuck, stopped or took "
                                          "another code path (or raise TFCS_TIMEOUT)")
    if kind == "CollectiveMismatchError":
        return CollectiveMismatchError(f"{which}: ranks called different collectives ({seen})",
                                       rank=rank, seq=seq, remote_rank=origin,
                                       fix="every rank must issue the same collectives in the same order with "
                                           "the same op, dtype, shape and root")
    return CollectiveAbortedError(f"rank {origin} aborted the process group after its own error: {message}",
                                  rank=rank, origin_rank=origin, seq=seq,
                                  fix=f"the cause is on rank {origin}; see the error above in its log")


_CLOSE = object()
RANK_METADATA_KEY = "tfcs-rank"


class PeerStream(Outbound):
    """A persistent client stream to one peer's ``Data/Send``."""

    def __init__(self, address: str, token: Optional[str], peer_rank: int, my_rank: int, tls=None, describe=None):
        self.address = address
        self._who = describe(peer_rank) if describe is not None else address
        self.peer_rank = peer_rank
        self.my_rank = my_rank
        self._channel = grpc_util.open_channel(address, tls=tls)
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        call = grpc_util.stream_unary(self._channel, SERVICE, "Send")
        metadata = tuple(grpc_util.call_metadata(token) or ()) + ((RANK_METADATA_KEY, str(my_rank)),)
        self._future = call.future(self._messages(), metadata=metadata, wait_for_ready=True)
        self._token = token

    def _messages(self):
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            yield item

    def broken(self) -> Optional[PeerLostError]:
        if not self._future.done():
            return None
        try:
            self._future.result(timeout=0)
            detail = "stream ended"
        except grpc.RpcError as e:
            detail = f"{e.code()}: {e.details()}"
        except Exception as e:  # pragma: no cover
            detail = repr(e)
        return PeerLostError(f"the data stream to rank {self.peer_rank} ({self._who}) closed ({detail})",
                             rank=self.my_rank, peer_rank=self.peer_rank, peer_address=self.address,
                             fix=f"rank {self.peer_rank} probably died; see its log")

    def send(self, msg: bytes) -> None:
        if self._future.done():
            raise self.broken()
        self._queue.put(msg)

    def send_frame(self, seq: int, step: int, chunk: int, sig: bytes, payload) -> None:
        """Frame and queue one chunk (one copy: gRPC's sync API sends only exact ``bytes``)."""
        self.send(wire.encode(seq, step, chunk, self.my_rank, sig, payload))

    def drain(self, timeout: float, abort=None) -> None:
        """Nothing to wait for: ``send_frame`` copied the payload already."""

    def close(self, timeout: float = 5.0) -> None:
        if not self._future.done():
            self._queue.put(wire.encode_bye(self.my_rank))
            self._queue.put(_CLOSE)
            try:
                self._future.result(timeout=timeout)
            except Exception:
                pass
        self._channel.close()


def send_abort(address: str, token: Optional[str], origin: int, message: str, timeout: float = 2.0,
               kind: str = "", peer: Optional[int] = None, tls=None, seq: Optional[int] = None,
               waiting_for=()) -> None:
    """Best effort: tell the peer at ``address`` that this rank aborted (``kind`` of error, lost ``peer``)."""
    ch = grpc_util.open_channel(address, tls=tls)
    body = {"origin": origin, "message": message, "kind": kind, "peer": peer, "seq": seq,
            "waiting_for": list(waiting_for)}
    try:
        grpc_util.unary(ch, SERVICE, "Abort")(json.dumps(body).encode(),
                                             timeout=timeout, metadata=grpc_util.call_metadata(token))
    except grpc.RpcError:
        pass
    finally:
        ch.close()
