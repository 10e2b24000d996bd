"""gRPC data path of the ring: a data server per rank and one persistent stream to the right peer.

* ``DataServer`` (service ``tfcs.Data``): ``Send`` is a client-streaming method; each incoming
  message is framed by ``wire`` and dropped into the ``Mailbox`` without copying its payload.
  A stream that ends without the BYE message means the sender died: the mailbox learns that the
  peer is lost, so a rank waiting for it fails within seconds (gRPC keepalive bounds a silent
  partition), not at the deadline. ``Abort`` lets a failing rank poison everybody's mailbox.
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
from ...errors import CollectiveAbortedError, PeerLostError
from . import wire

log = logging.getLogger("tf_commstrategy")
SERVICE = "Data"


class DataServer:
    def __init__(self, rank: int, world_size: int, bind: str, token: Optional[str],
                 mailbox: wire.Mailbox, describe_peer: Callable[[int], str]):
        self.rank = rank
        self.world_size = world_size
        self.mailbox = mailbox
        self._describe = describe_peer
        self._closing = threading.Event()
        self._bad_logged = False
        handlers = {"Send": ("stream", self._send), "Abort": ("unary", self._abort)}
        self._server, self.port = grpc_util.start_server(SERVICE, handlers, bind, token,
                                                         max_workers=world_size + 8)

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
        try:
            for msg in request_iterator:
                try:
                    seq, step, chunk, sender, sig, payload = wire.decode(msg, self.world_size)
                except wire.MalformedMessage as e:
                    self._log_bad(str(e))
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed data message: {e}")
                    return b""
                if step == wire.BYE_STEP:
                    self.mailbox.peer_gone(sender, PeerLostError(
                        f"rank {sender} ({self._describe(sender)}) shut down its process group while "
                        f"rank {self.rank} still expected data from it",
                        rank=self.rank, peer_rank=sender, peer_address=self._describe(sender),
                        fix="every rank must make the same collective calls; a rank left early"))
                    return b""
                self.mailbox.deposit((seq, step, chunk), sig, payload)
        except grpc.RpcError:
            pass
        except Exception as e:  # pragma: no cover - a handler must never die silently
            log.exception("tf_commstrategy rank %d: data stream handler failed: %s", self.rank, e)
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
        except (ValueError, KeyError, TypeError):
            self._log_bad("bad abort request")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed abort request")
            return b""
        self.mailbox.fail(CollectiveAbortedError(
            f"rank {origin} aborted the process group after its own error: {message}",
            rank=self.rank, origin_rank=origin,
            fix=f"the cause is on rank {origin}; see the error above in its log"))
        return b"{}"

    def stop(self, grace: float = 0.5) -> None:
        self._closing.set()
        self._server.stop(grace).wait(grace + 1.0)


_CLOSE = object()
RANK_METADATA_KEY = "tfcs-rank"


class PeerStream:
    """A persistent client stream to one peer's ``Data/Send``."""

    def __init__(self, address: str, token: Optional[str], peer_rank: int, my_rank: int):
        self.address = address
        self.peer_rank = peer_rank
        self.my_rank = my_rank
        self._channel = grpc_util.open_channel(address)
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
        return PeerLostError(f"the data stream to rank {self.peer_rank} at {self.address} closed ({detail})",
                             rank=self.my_rank, peer_rank=self.peer_rank, peer_address=self.address,
                             fix=f"rank {self.peer_rank} probably died; see its log")

    def send(self, msg: bytes) -> None:
        if self._future.done():
            raise self.broken()
        self._queue.put(msg)

    def send_frame(self, seq: int, step: int, chunk: int, sig: bytes, payload) -> None:
        """Frame and queue one chunk (one copy: gRPC's sync API sends only exact ``bytes``)."""
        self.send(wire.encode(seq, step, chunk, self.my_rank, sig, payload))

    def drain(self, timeout: float) -> None:
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


def send_abort(address: str, token: Optional[str], origin: int, message: str, timeout: float = 2.0) -> None:
    """Best effort: tell the peer at ``address`` that this rank aborted."""
    ch = grpc_util.open_channel(address)
    try:
        grpc_util.unary(ch, SERVICE, "Abort")(json.dumps({"origin": origin, "message": message}).encode(),
                                             timeout=timeout, metadata=grpc_util.call_metadata(token))
    except grpc.RpcError:
        pass
    finally:
        ch.close()
