"""The connections of one ring: who is left and right of this rank, and the data path to each.

The backend builds one ``RingLinks`` for the job's ring (every rank, in rank order) and, for the
hierarchical all-reduce, one per host (the ranks of a host) and one among the hosts' leaders. Each
ring has an id that namespaces its frames (``wire_step``) and its setup keys in the store, so the
rings share the rank's receive side (mailbox, data servers) without mixing their messages.

The data path of each neighbour pair follows ``socket_transport.choose``: shared memory when the
two share a host's memory, else Unix sockets on one host, raw TCP between hosts (gRPC with TLS); the
choice is computed from the rendezvous' worker facts only, so both ends always agree. A raw TCP link
that ``choose`` picked and that cannot be opened within ``config.TCP_CONNECT_S`` (a firewall that
opens only the gRPC port) falls back to gRPC: the sender publishes the route it took under
``sock/route/<ring>/<rank>`` and the receiver reads it before it waits for a connection.
"""

from __future__ import annotations

import logging
from typing import List, Optional

from ... import config
from ...core import shared_memory
from ...errors import RendezvousError
from . import setup_report, shm_transport, socket_transport, transport

log = logging.getLogger("tf_commstrategy")

#: Ring ids live in the high bits of a frame's step field (ring steps stay far below 2**20).
STEP_BITS = 20


def wire_step(ring_id: int, step: int) -> int:
    return (ring_id << STEP_BITS) | step


def link_kinds(workers, members: List[int], requested: str, tls: bool = False) -> List[str]:
    """The data path of each pair (members[i] -> members[i + 1]) of a ring, from the rendezvous'
    worker facts only: every rank computes the same list (``tls``: the job has TLS)."""
    n = len(members)
    pairs = [(workers[members[i]], workers[members[(i + 1) % n]]) for i in range(n)]
    return [socket_transport.choose(requested, a.local_link_key == b.local_link_key, a.shm_key == b.shm_key, tls)
            for a, b in pairs]


class RingLinks:
    """This rank's place in one ring (``members``: global ranks in ring order) and its two links."""

    def __init__(self, backend, ring_id: int, members: List[int], requested: str):
        self.ring_id = ring_id
        self.members = list(members)
        self.rank = members.index(backend.rank)  # position in this ring (what core.ring calls rank)
        self.size = len(members)
        self.left = members[(self.rank - 1) % self.size]    # global ranks of the neighbours
        self.right = members[(self.rank + 1) % self.size]
        self.stream = None
        self.inbound = None  # the left neighbour's frames read in the calling thread (shm or socket receiver)
        self._shm: Optional[shm_transport.ShmLinks] = None
        self.transport = "none"
        self.planned = "none"  # the outbound kind chosen from the worker facts (shm may fall back to unix)
        if self.size == 1:
            return
        try:
            outbound = self._connect(backend, ring_id, requested)
        except BaseException:  # a neighbour gone or a deadline while connecting: close what was opened
            self.close()
            raise
        self.transport = outbound
        # the job's report (setup_report, rank 0) names every link once; each rank's own at DEBUG
        log.debug("tf_commstrategy rank %d: %s data path to rank %d: %s", backend.rank,
                  setup_report.RING_NAMES.get(ring_id, "ring"), self.right, outbound)

    def _connect(self, backend, ring_id: int, requested: str) -> str:
        """Open the links to both neighbours (a collective step of init); returns the outbound kind."""
        g = backend.group
        w = g.workers
        kinds = link_kinds(w, self.members, requested, tls=g.tls is not None)
        inbound, outbound = kinds[(self.rank - 1) % self.size], kinds[self.rank]
        self.planned = outbound
        if "shm" in (inbound, outbound):
            local = sum(1 for x in w if x.host_key == w[backend.rank].host_key)
            spin = shared_memory.spin_seconds(local)
            self._shm = shm_transport.ShmLinks(g.store, backend.rank, self.left, self.right, inbound == "shm",
                                               outbound == "shm", [x.pid for x in w], backend.describe,
                                               backend.chunk_bytes, g.rendezvous_timeout, spin,
                                               prefix=f"shm{ring_id}")
            self.inbound = self._shm.receiver
            if inbound == "shm" and self.inbound is None:
                inbound = "unix"
            if outbound == "shm" and self._shm.sender is None:
                outbound = "unix"
        if inbound in ("unix", "tcp"):
            backend.socket_server(inbound)  # publishes its address for the left neighbour
        if outbound == "shm":
            self.stream = self._shm.sender
        elif outbound == "tcp" and requested != "tcp":  # chosen, not asked for: gRPC if it cannot be opened
            outbound = self._tcp_or_grpc(backend, ring_id)
        elif outbound in ("unix", "tcp"):
            addr = g.store.get(f"sock/{outbound}/{self.right}", g.rendezvous_timeout)
            self.stream = socket_transport.SocketSender.connect(addr, g.token, self.right, backend.rank,
                                                                g.rendezvous_timeout, describe=backend.describe,
                                                                ring_id=ring_id)
        else:
            self.stream = transport.PeerStream(backend.address_of(self.right), g.token, self.right, backend.rank,
                                               tls=g.tls, describe=backend.describe)
        if inbound == "tcp" and requested != "tcp":  # the route the left neighbour took
            inbound = g.store.get(f"sock/route/{ring_id}/{self.left}", g.rendezvous_timeout)
        if inbound in ("unix", "tcp"):  # the left neighbour connected to our server (or is about to)
            conn = backend.socket_server(inbound).take_connection(ring_id, self.left, g.rendezvous_timeout)
            self.inbound = socket_transport.SocketReceiver(conn, self.left, backend.rank, backend.describe, inbound)
        return outbound

    def _tcp_or_grpc(self, backend, ring_id: int) -> str:
        """Open the raw TCP link to the right neighbour, or gRPC when that fails within
        ``config.TCP_CONNECT_S``; publishes the route taken for the neighbour and returns it."""
        g = backend.group
        addr = g.store.get(f"sock/tcp/{self.right}", g.rendezvous_timeout)
        try:
            self.stream = socket_transport.SocketSender.connect(addr, g.token, self.right, backend.rank,
                                                                config.TCP_CONNECT_S, describe=backend.describe,
                                                                ring_id=ring_id)
            route = "tcp"
        except RendezvousError as e:
            log.warning("tf_commstrategy rank %d: no raw TCP data connection to rank %d (%s); this link uses gRPC "
                        "instead (TFCS_TRANSPORT=grpc skips the attempt)", backend.rank, self.right, e)
            self.stream = transport.PeerStream(backend.address_of(self.right), g.token, self.right, backend.rank,
                                               tls=g.tls, describe=backend.describe)
            route = "grpc"
        g.store.set(f"sock/route/{ring_id}/{backend.rank}", route)
        return route

    def shm_problem(self):
        """Why this rank's shared-memory links fell back to sockets (its own cause or a neighbour's), or None."""
        shm = self._shm
        if shm is None or not shm.fell_back:
            return None
        return shm.fallback_reason or "a neighbour could not use shared memory"

    def own_shm_problem(self):
        """Why this rank itself could not set up shared memory (not a neighbour's cause), or None."""
        return self._shm.own_problem if self._shm is not None else None

    def close(self) -> None:
        closed = []
        if self.stream is not None:
            closed.append(self.stream)
            self.stream.close()
            self.stream = None
        if self.inbound is not None:
            closed.append(self.inbound)
            self.inbound.close()
            self.inbound = None
        if self._shm is not None:  # parts not handed to stream / inbound (an init that failed halfway)
            for part in (self._shm.sender, self._shm.receiver):
                if part is not None and not any(part is c for c in closed):
                    part.close()
        self._shm = None
