"""What the host backend sets up once, when the process group is made: its servers, its rings and each
ring link's data path, and the one-host shared-memory machinery; decided from job-wide facts only, so
every rank makes the same decisions.

* The data path to each ring neighbour: shared memory (else Unix sockets) on one host, gRPC (or opt-in
  raw TCP) between hosts (``links.link_kinds``). The ring's chunk size and the small all-reduce limit
  follow from the paths.
* Every rank on one host: the shared all-reduce buffers (``shm_buffers``; with 2 ranks only their
  one-round path for small all-reduces), and cross-memory reads of the peers' private arrays for large
  ones where the kernel allows them (``shm_cma``).
* Several hosts with several ranks on some: a ring per host and a ring of the hosts' first ranks, for
  the hierarchical all-reduce.

Rank 0 reports the job's data paths and what could not be set up once (``setup_report``).
"""

from __future__ import annotations

import logging
from typing import Dict, FrozenSet, List, Optional

from ... import config
from ...core import cpus, shared_memory
from ...rendezvous.cluster_env import join_host_port
from . import links, setup_report, shm_buffers, shm_cma, shm_layout, socket_transport, transport

log = logging.getLogger("tf_commstrategy")

#: in a job holding shared arrays, in-place all-reduces of more than this many bytes try the direct path;
#: smaller ones take the one-round path of the shared all-reduce buffers, whose one copy in costs less than
#: the direct path's handshake (the limit is the one-round path's own, shm_layout.SMALL_BYTES)
DIRECT_ABOVE_BYTES = 64 << 10
#: data area of the flag segments made for shared arrays when there are no shared buffers (unused data)
DIRECT_FLAGS_BYTES = 4096


class HostLayout:
    """The host backend's rings, servers and shared-memory machinery (one per host backend).

    Attributes:
      chunk_bytes: the ring's pipelining unit (the same on every rank).
      small_bytes: all-reduces of at most this many bytes x (size - 1) take one all-gather pass.
      transport: this rank's outbound data path on the job's ring ("shm", "unix", "tcp", "grpc").
      planned_kinds: the data paths the job's ring was planned with (job-wide).
      all_shm: every rank shares one host's memory.
      ring, host_ring, leader_ring: the job's ring; with the hierarchy, this host's and the leaders'.
      buffers: the shared all-reduce buffers (every rank on one host), else None.
      direct: the flags of the direct all-reduce (the shared buffers', or buffers of their own).
      cma_bytes: all-reduces from this size read the peers' private arrays (0: never).
    """

    def __init__(self, backend):
        self._b = backend
        g = backend.group
        self.rank, self.size = g.rank, g.size
        self.chunk_bytes: Optional[int] = g.chunk_bytes
        self.small_bytes: Optional[int] = config.small_bytes_from_env()  # None: decided with the links
        self.transport = "none"
        self.planned_kinds: FrozenSet[str] = frozenset()
        self.all_shm = False
        self.hierarchical = False
        self.ring: Optional[links.RingLinks] = None
        self.host_ring: Optional[links.RingLinks] = None
        self.leader_ring: Optional[links.RingLinks] = None
        self.buffers: Optional[shm_buffers.SharedBuffers] = None
        self.direct: Optional[shm_buffers.SharedBuffers] = None
        self.direct_tried = False
        self.cma_bytes = 0
        self._cma_reader: Optional[int] = None  # the peer allowed to read this process (Yama), until close
        self.server: Optional[transport.DataServer] = None
        self.socket_servers: Dict[str, socket_transport.SocketServer] = {}
        if self.size == 1:
            self.chunk_bytes = self.chunk_bytes or config.DEFAULT_CHUNK_BYTES
            self.small_bytes = self.small_bytes or 0

    # -- setup (a collective step of init) -------------------------------------------------------------
    def connect(self) -> None:
        b, g = self._b, self._b.group
        self.server = transport.DataServer(self.rank, self.size, join_host_port(g.bind_host, 0), g.token,
                                           b.mailbox, b.peers.describe, progress=b.progress, tls=g.tls)
        g.store.set(f"grpc/addr/{self.rank}", join_host_port(g.advertise_host, self.server.port))
        requested = config.parse_transport(g.transport)
        kinds = links.link_kinds(g.workers, list(range(self.size)), requested, tls=g.tls is not None)
        self.planned_kinds = frozenset(kinds)
        self.all_shm = all(k == "shm" for k in kinds)
        self._choose_sizes(kinds)
        b.peers.addresses = [g.store.get(f"grpc/addr/{i}", g.rendezvous_timeout) for i in range(self.size)]
        self.ring = links.RingLinks(b, 0, list(range(self.size)), requested)
        self.transport = self.ring.transport
        problems = []  # (what, why): shared memory this rank could not set up (rank 0 warns once per job)
        buffers_state = None  # what became of the shared all-reduce buffers, when the job planned them
        if self.all_shm:
            buffers_state = self._make_buffers(problems)
            self._setup_cma()
        hosts = self._make_hierarchy(requested)
        rings = (self.ring, self.host_ring, self.leader_ring)
        own = [r.own_shm_problem() for r in rings if r is not None and r.own_shm_problem()]
        distinct = {}  # each cause once, in ring order (the rings' texts differ only in the free space seen)
        for why in own:
            distinct.setdefault(setup_report.cause_key(why), why)
        problems[:0] = [("shared-memory links", why) for why in distinct.values()]
        setup_report.publish(g.store, self.rank, self.size, g.rendezvous_timeout,
                             setup_report.my_facts(rings, problems, buffers_state), hosts)

    def _choose_sizes(self, kinds: List[str]) -> None:
        """The ring's chunk and the small all-reduce limit, the same on every rank (chunk keys must agree
        around the ring, and the limit picks the algorithm)."""
        if self.chunk_bytes is None:
            if "shm" in kinds:
                self.chunk_bytes = config.DEFAULT_SHM_CHUNK_BYTES
            elif all(k in ("unix", "tcp") for k in kinds):
                self.chunk_bytes = self._socket_chunk_bytes()
            else:
                self.chunk_bytes = config.DEFAULT_CHUNK_BYTES
        if self.small_bytes is None:
            self.small_bytes = config.DEFAULT_SHM_SMALL_BYTES if self.all_shm else config.DEFAULT_SMALL_BYTES

    def _socket_chunk_bytes(self) -> int:
        """The ring's chunk when every link is a raw socket: the short one while every rank has a core of
        its own on its host, the long one when some host has more ranks than cores. A collective step:
        each rank publishes whether its host is crowded, so every rank picks the same size."""
        g, w = self._b.group, self._b.group.workers
        here = sum(1 for x in w if x.local_link_key == w[self.rank].local_link_key)
        crowded = here > cpus.usable_cores()
        g.store.set(f"grpc/crowded/{self.rank}", "1" if crowded else "0")
        theirs = [g.store.get(f"grpc/crowded/{q}", g.rendezvous_timeout) for q in range(self.size) if q != self.rank]
        if crowded or "1" in theirs:
            return config.CROWDED_SOCKET_CHUNK_BYTES
        return config.DEFAULT_SOCKET_CHUNK_BYTES

    def _make_buffers(self, problems: list) -> str:
        """Every rank shares this host's memory: the shared all-reduce buffers. With 2 ranks only their
        one-round path for small all-reduces (one wake-up instead of a ring's two steps); above that the
        2-rank ring moves less (it copies 1.5x the buffer, the shared buffers 2x); from 3 ranks the ring's
        copies grow with the ranks and the buffers' do not. Returns what became of them."""
        g, w = self._b.group, self._b.group.workers
        buffers_bytes = config.shm_buffers_bytes_from_env()
        if self.size == 2:  # only the one-round path's two slots are used
            buffers_bytes = min(buffers_bytes, shm_layout.SMALL_PATH_CAPACITY)
        self.buffers, problem = shm_buffers.SharedBuffers.create(
            g.store, self.rank, self.size, [x.pid for x in w], self._b.peers.describe, buffers_bytes,
            g.rendezvous_timeout, shared_memory.spin_seconds(self.size), known_problem=self.ring.shm_problem())
        if problem:
            problems.append(("shared all-reduce buffers", problem))
        self.direct = self.buffers
        self.direct_tried = self.buffers is not None  # the same on every rank (not each rank's setting)
        if self.buffers is not None and self.rank == 0:
            if self.size == 2:
                log.info("tf_commstrategy: all-reduces of at most %d KiB through shared buffers (2 ranks on one "
                         "host)", self.buffers.small_bytes >> 10)
            else:
                log.info("tf_commstrategy: all-reduce through shared buffers (%d ranks on one host, %d MiB "
                         "each)", self.size, self.buffers.capacity >> 20)
        return "used" if self.buffers is not None else "off" if buffers_bytes <= 0 else "dropped"

    def _setup_cma(self) -> None:
        """Every rank on one host: can every rank read every peer's memory (``shm_cma.probe``)? Then large
        all-reduces of private arrays read the peers' arrays where they are, coordinated through the
        shared buffers' flags (or flag buffers of their own when those are off). A collective step."""
        g = self._b.group
        agreed, why, self._cma_reader = shm_cma.probe(g.store, "cma", self.rank, self.size,
                                                      [x.pid for x in g.workers], config.shm_cma_bytes_from_env(),
                                                      g.rendezvous_timeout)
        # they start after the handshake's own floor (smaller thresholds would be reported, not used)
        self.cma_bytes = max(agreed, DIRECT_ABOVE_BYTES + 1) if agreed else 0
        if self.cma_bytes and self.direct is None:  # every rank alike
            why = self.make_direct_flags(g.rendezvous_timeout)
            if self.direct is None:
                self.cma_bytes, why = 0, why or "a peer could not create its flag buffer"
                shm_cma.forget_reader(self._cma_reader)
                self._cma_reader = None
        if self.rank == 0:
            if self.cma_bytes:
                n = self.cma_bytes
                log.info("tf_commstrategy: all-reduces of at least %s read the peers' arrays by cross-memory "
                         "attach (process_vm_readv)", f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n >> 10} KiB")
            else:
                log.info("tf_commstrategy: no cross-memory reads (%s); large all-reduces of private arrays take "
                         "the %s", why, "shared buffers" if self.size >= 3 and self.buffers is not None else "ring")

    def _make_hierarchy(self, requested: str) -> int:
        """Several hosts, several ranks on some: all-reduce within each host, then among one leader per
        host, then broadcast within the host, as NCCL and MPI do. Returns the number of hosts."""
        b, w = self._b, self._b.group.workers
        hosts = {}
        for x in w:
            hosts.setdefault(x.local_link_key, []).append(x.rank)
        groups = sorted(hosts.values())
        if config.hierarchical_from_env() and len(groups) > 1 and max(len(m) for m in groups) > 1:
            self.hierarchical = True
            mine = next(m for m in groups if self.rank in m)
            self.host_ring = links.RingLinks(b, 1, mine, requested)
            leaders = [m[0] for m in groups]
            if self.rank in leaders:
                self.leader_ring = links.RingLinks(b, 2, leaders, requested)
        return len(hosts)

    def make_direct_flags(self, timeout: float) -> Optional[str]:
        """Flag buffers of their own for the direct all-reduce (shared arrays, cross-memory reads) when the
        job has no shared all-reduce buffers: a collective step, tried once. Returns this rank's problem
        (``direct`` stays None on every rank alike) or None."""
        g = self._b.group
        self.direct_tried = True
        self.direct, problem = shm_buffers.SharedBuffers.create(
            g.store, self.rank, self.size, [x.pid for x in g.workers], self._b.peers.describe,
            DIRECT_FLAGS_BYTES, timeout, shared_memory.spin_seconds(self.size), prefix="shmdirect")
        return problem

    def neighbours(self) -> set:
        """The ranks next to this one on any of its rings (the heartbeats watch them)."""
        out = {(self.rank - 1) % self.size, (self.rank + 1) % self.size}
        for r in (self.host_ring, self.leader_ring):
            if r is not None and r.size > 1:
                out |= {r.left, r.right}
        return out

    def socket_server(self, kind: str) -> socket_transport.SocketServer:
        """This rank's server for ``kind`` ("unix" / "tcp") data connections, started on first use."""
        srv = self.socket_servers.get(kind)
        if srv is None:
            g = self._b.group
            srv = socket_transport.SocketServer(self.rank, self.size, kind, g.bind_host, g.token,
                                                self._b.peers.describe)
            self.socket_servers[kind] = srv
            g.store.set(f"sock/{kind}/{self.rank}", srv.address or join_host_port(g.advertise_host, srv.port))
        return srv

    def close(self) -> None:
        for r in (self.ring, self.host_ring, self.leader_ring):
            if r is not None:
                r.close()
        self.ring = self.host_ring = self.leader_ring = None
        shm_cma.forget_reader(self._cma_reader)
        self._cma_reader = None
        if self.direct is not None and self.direct is not self.buffers:
            self.direct.close()
        self.direct = None
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        for srv in self.socket_servers.values():
            srv.stop()
        self.socket_servers = {}
