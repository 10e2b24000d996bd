"""The "grpc" backend: the ring algorithms of ``core.ring`` over gRPC streams (numpy in, numpy out)."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import List, Optional, Tuple

import numpy as np

from ... import config
from ...core import ring, shared_memory
from ...core.backend import Backend, BackendStats, Capabilities, register_backend
from ...core.reduce_ops import ReduceOp, finish_mean, needs_wide_accumulator
from ...rendezvous.cluster_env import join_host_port
from ...errors import CollectiveAbortedError, CollectiveError, PeerLostError, TfcsError, UnsupportedOperationError
from . import (links, liveness, setup_report, shm_cma, shm_fusion, shm_shared, socket_transport, transport,
               wire)
from .ring_link import SINGLE, CollectiveLink

log = logging.getLogger("tf_commstrategy")

#: in a job holding shared arrays, in-place all-reduces of more than this many bytes try the direct path;
#: smaller ones take the one-round path of the shared all-reduce buffers, whose one copy in costs less than
#: the direct path's handshake (the limit is the one-round path's own, shm_fusion.SMALL_BYTES)
DIRECT_ABOVE_BYTES = 64 << 10
#: data area of the flag segments made for shared arrays when there are no fusion buffers (unused data)
DIRECT_FLAGS_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class HostStats(BackendStats):
    """What the host backend has done, and which paths it took.

    Attributes:
      pending_messages: frames received for collectives this rank has not entered yet.
      busy_s: seconds spent inside collectives.
      transport: the ring's data path ("shm", "unix", "tcp", "grpc", or a mix such as "shm+tcp").
      allreduce_path: the path of a large all-reduce: "ring", "hierarchical", "shm-buffers" (3+ ranks
        on one host), "ring (small: shm-buffers)" (2 ranks on one host: small ones take the buffers).
      shared_arrays: whether this rank holds arrays of ``shared_empty`` now.
      direct_allreduces: in-place all-reduces of shared arrays that read the peers' arrays where they are.
      cma_allreduces: all-reduces that read the peers' private arrays by cross-memory reads.
      cross_memory_bytes: the size from which all-reduces read the peers' arrays (0: never).
    """

    pending_messages: int = 0
    busy_s: float = 0.0
    transport: str = ""
    allreduce_path: str = ""
    shared_arrays: bool = False
    direct_allreduces: int = 0
    cma_allreduces: int = 0
    cross_memory_bytes: int = 0


class GrpcRingBackend(Backend):
    """Ring collectives over gRPC. One instance per process group."""

    name = "grpc"
    capabilities = Capabilities(out_arrays=True, shared_arrays=True)

    def __init__(self, group):
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.chunk_bytes = group.chunk_bytes
        self.small_bytes = config.small_bytes_from_env()  # None: decided with the links (_connect)
        if self.size == 1:
            self.chunk_bytes = self.chunk_bytes or config.DEFAULT_CHUNK_BYTES
            self.small_bytes = self.small_bytes or 0
        self.mailbox = wire.Mailbox()
        self.mailbox.on_fail = group.failed  # layers above learn of the group's failure
        self.mailbox.on_reject = lambda what: log.warning(
            "tf_commstrategy rank %d: dropped a data frame that names no current collective (%s); further "
            "ones are not logged", self.rank, what)
        self._lock = threading.Lock()
        self._seq = 0
        self._busy_s = 0.0  # time spent inside collectives (for step-time splits in benchmarks)
        self._failed: Optional[BaseException] = None
        self._addresses: List[str] = []
        self._server = None
        self._socket_servers = {}          # "unix" / "tcp" -> SocketServer (one per kind, all rings)
        self._ring: Optional[links.RingLinks] = None       # the job's ring, every rank in rank order
        self._host_ring: Optional[links.RingLinks] = None  # hierarchy: the ranks of this host
        self._leader_ring: Optional[links.RingLinks] = None  # hierarchy: one rank per host
        self._allreduce_sigs: dict = {}
        self._fusion: Optional[shm_fusion.FusionBuffers] = None  # the whole job on one host: shared buffers
        # the in-place all-reduce of arrays from shared_empty: the fusion buffers' flags (with 2 ranks, or
        # the fusion buffers turned off: buffers of their own, made at the first shared_empty)
        self._direct: Optional[shm_fusion.FusionBuffers] = None
        self._direct_tried = False
        self._shared = shm_shared.SharedArrays(self.rank, self.size)
        self._all_shm = False  # every link of the job planned over shared memory (one host's memory)
        self._cma_bytes = 0  # all-reduces from this size read the peers' private arrays (0: never)
        self._cma_reader: Optional[int] = None  # the peer allowed to read this process (Yama), until close
        self.hierarchical = False
        self._watchdog: Optional[liveness.Watchdog] = None
        self._probes = {}
        self._lost = set()
        self.transport = "none"
        if self.size > 1:
            try:
                self._connect()
                self._start_watchdog()
            except BaseException:  # no server, socket or shared-memory segment outlives a failed setup
                self.close()
                raise

    # -- setup -----------------------------------------------------------------------------------
    def _connect(self) -> None:
        g = self.group
        self._server = transport.DataServer(self.rank, self.size, join_host_port(g.bind_host, 0), g.token,
                                            self.mailbox, self.describe, progress=self._progress, tls=g.tls)
        me = join_host_port(g.advertise_host, self._server.port)
        g.store.set(f"grpc/addr/{self.rank}", me)
        # The data path to each ring neighbour: shared memory (else unix sockets) on one host, grpc (or
        # opt-in tcp) between hosts. Decided from the rendezvous' worker facts only, so every rank
        # computes the same list (the chunk size below depends on it).
        requested = config.parse_transport(g.transport)
        w = g.workers
        kinds = links.link_kinds(w, list(range(self.size)), requested)
        self._planned_kinds = frozenset(kinds)
        self._all_shm = all(k == "shm" for k in kinds)
        if self.chunk_bytes is None:  # the same on every rank: chunk keys must agree around the ring
            if "shm" in kinds:
                self.chunk_bytes = config.DEFAULT_SHM_CHUNK_BYTES
            elif all(k in ("unix", "tcp") for k in kinds):
                self.chunk_bytes = self._socket_chunk_bytes()
            else:
                self.chunk_bytes = config.DEFAULT_CHUNK_BYTES
        if self.small_bytes is None:  # the same on every rank too: it picks the algorithm
            self.small_bytes = (config.DEFAULT_SHM_SMALL_BYTES if all(k == "shm" for k in kinds)
                                else config.DEFAULT_SMALL_BYTES)
        self._addresses = [g.store.get(f"grpc/addr/{i}", g.rendezvous_timeout) for i in range(self.size)]
        self._ring = links.RingLinks(self, 0, list(range(self.size)), requested)
        self.transport = self._ring.transport
        problems = []  # (what, why): shared memory this rank could not set up (rank 0 warns once per job)
        fusion_state = None  # what became of the shared all-reduce buffers, when the job planned them
        if all(k == "shm" for k in kinds) and self.size >= 2:
            # every rank shares this host's memory: all-reduce through shared buffers, not the ring. With
            # 2 ranks only the small ones (their one-round path: one wake-up instead of a ring's two steps);
            # above that the 2-rank ring moves less (it copies 1.5x the buffer, the shared buffers 2x);
            # from 3 ranks the ring's copies grow with the ranks and the buffers' do not. Large
            # all-reduces, at any world size, read the peers' arrays by cross-memory reads where the
            # kernel allows them (_setup_cma): fewer bytes through memory than either
            # (docs/backends.md, the table of host paths)
            spin = shared_memory.spin_seconds(self.size)
            links_problem = self._ring.shm_problem()
            fusion_bytes = config.shm_fusion_bytes_from_env()
            if self.size == 2:  # only the one-round path's two slots are used
                fusion_bytes = min(fusion_bytes, shm_fusion.SMALL_PATH_CAPACITY)
            self._fusion, fusion_problem = shm_fusion.FusionBuffers.create(
                g.store, self.rank, self.size, [x.pid for x in w], self.describe, fusion_bytes,
                g.rendezvous_timeout, spin, known_problem=links_problem)
            if fusion_problem:
                problems.append(("shared all-reduce buffers", fusion_problem))
            fusion_state = ("used" if self._fusion is not None
                            else "off" if fusion_bytes <= 0 else "dropped")
            self._direct = self._fusion
            self._direct_tried = self._fusion is not None  # the same on every rank (not each rank's setting)
            if self._fusion is not None and self.rank == 0:
                if self.size == 2:
                    log.info("tf_commstrategy: all-reduces of at most %d KiB through shared buffers (2 ranks on one "
                             "host)", self._fusion.small_bytes >> 10)
                else:
                    log.info("tf_commstrategy: all-reduce through shared buffers (%d ranks on one host, %d MiB "
                             "each)", self.size, self._fusion.capacity >> 20)
            self._setup_cma(g)
        # Hierarchy (several hosts, several ranks on some): all-reduce within each host, then among one
        # leader per host, then broadcast within the host, as NCCL and MPI do.
        hosts = {}
        for x in w:
            hosts.setdefault(x.local_link_key, []).append(x.rank)
        groups = sorted(hosts.values())
        if config.hierarchical_from_env() and len(groups) > 1 and max(len(m) for m in groups) > 1:
            self.hierarchical = True
            mine = next(m for m in groups if self.rank in m)
            self._host_ring = links.RingLinks(self, 1, mine, requested)
            leaders = [m[0] for m in groups]
            if self.rank in leaders:
                self._leader_ring = links.RingLinks(self, 2, leaders, requested)
        rings = (self._ring, self._host_ring, self._leader_ring)
        own = [r.own_shm_problem() for r in rings if r is not None and r.own_shm_problem()]
        distinct = {}  # each cause once, in ring order (the rings' texts differ only in the free space seen)
        for why in own:
            distinct.setdefault(setup_report.cause_key(why), why)
        problems[:0] = [("shared-memory links", why) for why in distinct.values()]
        setup_report.publish(g.store, self.rank, self.size, g.rendezvous_timeout,
                             setup_report.my_facts(rings, problems, fusion_state), len(hosts))

    def _socket_chunk_bytes(self) -> int:
        """The ring's chunk when every link is a raw socket: 1 MiB while every rank has a core of its own
        on its host (a chunk then is reduced while it is still in the cache), 4 MiB when some host has
        more ranks than cores (fewer hand-offs between the ranks sharing a core). A collective step:
        each rank publishes whether its host is crowded, so every rank picks the same size."""
        g, w = self.group, self.group.workers
        here = sum(1 for x in w if x.local_link_key == w[self.rank].local_link_key)
        crowded = here > (os.cpu_count() or 1)
        g.store.set(f"grpc/crowded/{self.rank}", "1" if crowded else "0")
        theirs = [g.store.get(f"grpc/crowded/{q}", g.rendezvous_timeout) for q in range(self.size) if q != self.rank]
        if crowded or "1" in theirs:
            return config.CROWDED_SOCKET_CHUNK_BYTES
        return config.DEFAULT_SOCKET_CHUNK_BYTES

    def _setup_cma(self, g) -> None:
        """Every rank on one host: can every rank read every peer's memory (``shm_cma.probe``)? Then large
        all-reduces of private arrays read the peers' arrays where they are, coordinated through the
        fusion buffers' flags (or flag buffers of their own when those are off). A collective step."""
        agreed, why, self._cma_reader = shm_cma.probe(g.store, "cma", self.rank, self.size,
                                                      [x.pid for x in g.workers], config.shm_cma_bytes_from_env(),
                                                      g.rendezvous_timeout)
        # they start after the handshake's own floor (smaller thresholds would be reported, not used)
        self._cma_bytes = max(agreed, DIRECT_ABOVE_BYTES + 1) if agreed else 0
        if self._cma_bytes and self._direct is None:  # every rank alike
            why = self._make_direct_flags(g.rendezvous_timeout)
            if self._direct is None:
                self._cma_bytes, why = 0, why or "a peer could not create its flag buffer"
                shm_cma.forget_reader(self._cma_reader)
                self._cma_reader = None
        if self.rank == 0:
            if self._cma_bytes:
                b = self._cma_bytes
                log.info("tf_commstrategy: all-reduces of at least %s read the peers' arrays by cross-memory "
                         "attach (process_vm_readv)", f"{b >> 20} MiB" if b % (1 << 20) == 0 else f"{b >> 10} KiB")
            else:
                log.info("tf_commstrategy: no cross-memory reads (%s); large all-reduces of private arrays take "
                         "the %s", why, "shared buffers" if self.size >= 3 and self._fusion is not None else "ring")

    def serves_transport(self, name: str) -> bool:
        """Whether a call that asks for transport ``name`` runs on the links this job set up: "auto",
        the transport the job asked for, or the one kind that every link of the job's ring was planned
        with ("shm" when all ranks share a host's memory). Decided from job-wide facts only, so every
        rank gives the same answer (a rank's own links may differ from its neighbours')."""
        n = config.parse_transport(name)
        return n in ("auto", config.parse_transport(self.group.transport)) or self._planned_kinds == {n}

    @property
    def fusion(self) -> Optional[shm_fusion.FusionBuffers]:
        """The shared all-reduce buffers' flags (every rank on one host), whose words tell which collective
        each rank has entered; else None."""
        return self._direct

    def _fusion_takes(self, nbytes: int) -> bool:
        """Whether an all-reduce of ``nbytes`` goes through the shared all-reduce buffers: every size with
        3 or more ranks, only the one-round small path's with 2 (job-wide facts: every rank agrees)."""
        f = self._fusion
        return f is not None and (self.size >= 3 or 0 < nbytes <= f.small_bytes)

    def socket_server(self, kind: str):
        """This rank's server for ``kind`` ("unix" / "tcp") data connections, started on first use."""
        srv = self._socket_servers.get(kind)
        if srv is None:
            g = self.group
            srv = socket_transport.SocketServer(self.rank, self.size, kind, g.bind_host, g.token, self.describe)
            self._socket_servers[kind] = srv
            g.store.set(f"sock/{kind}/{self.rank}", srv.address or join_host_port(g.advertise_host, srv.port))
        return srv

    def address_of(self, rank: int) -> str:
        return self._addresses[rank] if rank < len(self._addresses) else "?"

    def describe(self, rank: int) -> str:
        """'host NAME, pid N, ADDRESS' of a rank, for error messages."""
        try:
            w = self.group.workers[rank]
            return f"host {w.hostname}, pid {w.pid}, {self.address_of(rank)}"
        except (IndexError, AttributeError, TypeError):
            return self.address_of(rank)

    # -- liveness --------------------------------------------------------------------------------
    def _progress(self) -> dict:
        return {"started": self._seq, "failed": self._failed is not None}

    def _probe(self, rank: int) -> liveness.PeerProbe:
        p = self._probes.get(rank)
        if p is None:
            p = self._probes[rank] = liveness.PeerProbe(self.address_of(rank), self.group.token, self.rank,
                                                        tls=self.group.tls)
        return p

    def _start_watchdog(self) -> None:
        timeout = config.heartbeat_timeout_from_env()
        if timeout <= 0:
            return
        neighbours = {(self.rank - 1) % self.size, (self.rank + 1) % self.size}
        for r in (self._host_ring, self._leader_ring):
            if r is not None and r.size > 1:
                neighbours |= {r.left, r.right}
        neighbours = sorted(neighbours - {self.rank})
        probes = {r: self._probe(r) for r in neighbours}
        self._watchdog = liveness.Watchdog(self.rank, neighbours, probes, self.describe, self._peer_lost,
                                           interval=min(1.0, timeout / 4), timeout=timeout,
                                           is_gone=self.mailbox.is_gone)

    def _peer_lost(self, rank: int, error: BaseException) -> None:
        self._lost.add(rank)
        self._fail(error, notify_peers=True)

    def arrivals(self, seq: int, waited_on: int):
        """After a timeout at collective ``seq``: (arrived ranks, missing ranks, text about the missing)."""
        answers = liveness.progress_of({r: self._probe(r) for r in range(self.size)
                                        if r != self.rank and r not in self._lost})
        arrived, missing, notes = [self.rank], [], []
        for r in range(self.size):
            if r == self.rank:
                continue
            a = answers.get(r)
            if a is not None and int(a.get("started", 0)) > seq:
                arrived.append(r)
                continue
            missing.append(r)
            if a is None:
                notes.append(f"rank {r} ({self.describe(r)}) did not answer (stopped, hung or unreachable)")
            else:
                last = int(a.get("started", 0)) - 1
                notes.append(f"rank {r} ({self.describe(r)}) is alive but its last collective is "
                             f"#{last}" + (" (it failed)" if a.get("failed") else ""))
        if not missing:  # everyone has arrived: the data from the left neighbour is what is late
            missing = [waited_on]
            notes = [f"none (every rank had entered it; rank {waited_on} ({self.describe(waited_on)}) did not "
                     f"deliver its data in time)"]
        return sorted(arrived), missing, "; ".join(notes)

    # -- running one collective ------------------------------------------------------------------
    def _run(self, sig: str, timeout: Optional[float], body):
        timeout = config.call_timeout(timeout, self.group.timeout, self.rank)
        with self._lock:
            if self._failed is None:  # a layer above whose own collectives failed (the compiled all-reduce)
                above = self.group.layer_failure()
                if above is not None:
                    self._fail(above, notify_peers=True)
            if self._failed is not None:
                raise CollectiveError(f"the process group is unusable after an earlier error: {self._failed}",
                                      rank=self.rank,
                                      fix="shut down (tfcs.shutdown()) and restart the job; errors are not "
                                          "recoverable inside one process group")
            seq = self._seq
            self._seq += 1
            if self.size == 1:
                return body(None)
            t0 = time.monotonic()
            link = CollectiveLink(self, self._ring, seq, sig, t0 + timeout, timeout)
            if self._direct is not None:  # the fusion buffers' flags, when there are any
                self._direct.enter(seq, sig)
            watches = self.group.collective_watches
            for w in watches:
                w.python_enter()
            try:
                result = body(link)
                link.finish()
                self.mailbox.forget(seq)
                return result
            except TfcsError as e:
                if getattr(e, "await_report", False):
                    reported = self._reported_cause(e)
                    if reported is not e:
                        self._fail(reported, notify_peers=True)
                        raise reported from None
                self._fail(e, notify_peers=True)
                raise
            except Exception as e:
                err = CollectiveError(f"collective #{seq} [{sig}] failed: {e!r}", rank=self.rank, seq=seq)
                self._fail(err, notify_peers=True)
                raise err from e
            finally:
                for w in watches:
                    w.python_leave()
                self._busy_s += time.monotonic() - t0

    def _reported_cause(self, error: BaseException) -> BaseException:
        """``error`` came from a neighbour's connection closing: wait up to ``config.GONE_GRACE_S`` for
        the failure another rank reports over gRPC (the real cause), else keep ``error``."""
        end = time.monotonic() + config.GONE_GRACE_S
        while time.monotonic() < end:
            reported = self.mailbox.error_now()
            if reported is not None:
                return reported
            time.sleep(0.01)
        return error

    def failure(self) -> Optional[BaseException]:
        return self._failed or self.mailbox.error_now()  # an Abort from another rank counts, idle or not

    def _fail(self, error: BaseException, notify_peers: bool) -> None:
        if self._failed is not None:
            return
        self._failed = error
        self.mailbox.fail(error)
        if notify_peers and self.size > 1:
            if isinstance(error, CollectiveAbortedError) or error is self.mailbox.remote_error:
                return  # it came from another rank, which notified everybody already
            msg = f"{type(error).__name__}: {error}"
            peer = getattr(error, "peer_rank", None) if isinstance(error, PeerLostError) else None
            if peer is not None:
                self._lost.add(peer)
            kw = {"kind": type(error).__name__, "peer": peer, "tls": self.group.tls,
                  "seq": getattr(error, "seq", None), "waiting_for": getattr(error, "waiting_for", ())}
            threads = [threading.Thread(target=transport.send_abort,
                                        args=(a, self.group.token, self.rank, msg), kwargs=kw, daemon=True)
                       for i, a in enumerate(self._addresses) if i != self.rank and i not in self._lost]
            for t in threads:
                t.start()
            for t in threads:
                t.join(3.0)

    def abort(self, error: BaseException) -> None:
        self._fail(error, notify_peers=True)

    def _chunk_elems(self, dtype, op: Optional[ReduceOp] = None) -> int:
        """Elements per chunk; float16 / bfloat16 reductions travel as float32 partials, so they are
        counted at 4 bytes (a chunk on the wire never exceeds ``chunk_bytes``)."""
        wire = np.float32 if op is not None and needs_wide_accumulator(np.dtype(dtype), op) else dtype
        return max(1, self.chunk_bytes // max(np.dtype(dtype).itemsize, np.dtype(wire).itemsize))

    # -- collectives -----------------------------------------------------------------------------

    def allreduce(self, buf: np.ndarray, op: ReduceOp, timeout=None, out: Optional[np.ndarray] = None) -> np.ndarray:
        """``out`` (C-contiguous, same shape and dtype; may be ``buf``: in place) receives the result;
        without it a new array does. ``buf`` itself is only read unless it is ``out``."""
        key = (op, buf.dtype, buf.shape)
        sig = self._allreduce_sigs.get(key)
        if sig is None:  # formatting a dtype's name costs more than the small all-reduce's own bookkeeping
            if len(self._allreduce_sigs) > 256:
                self._allreduce_sigs.clear()
            sig = self._allreduce_sigs[key] = f"allreduce op={op.value} dtype={buf.dtype} shape={tuple(buf.shape)}"
        src = np.ascontiguousarray(buf).reshape(-1)
        if out is None:
            flat = np.empty_like(src)
        else:
            if (out.shape != buf.shape or out.dtype != buf.dtype or not out.flags.c_contiguous
                    or not out.flags.writeable):
                raise UnsupportedOperationError(
                    f"out= must be a writeable C-contiguous array of shape {buf.shape} and dtype {buf.dtype}; "
                    f"got shape {out.shape}, dtype {out.dtype}"
                    + ("" if out.flags.writeable else ", read-only"), rank=self.rank,
                    fix="pass out=np.empty_like(x) or out=x (in place, x writeable)")
            flat = out.reshape(-1)
        if flat is src or (out is not None and np.shares_memory(flat, src)):
            if flat.__array_interface__["data"][0] != src.__array_interface__["data"][0]:
                raise UnsupportedOperationError(
                    "out= overlaps the input without being it (e.g. x[:-1] into x[1:]): the reduction would "
                    "read values it has already overwritten", rank=self.rank,
                    fix="pass out=x (in place) or an array that does not overlap x")
            src = None  # in place
        result = self._allreduce_flat(flat, op, timeout, sig, src)
        return out if out is not None else result.reshape(buf.shape)

    def _allreduce_flat(self, flat: np.ndarray, op: ReduceOp, timeout, sig: str, src: Optional[np.ndarray] = None):
        """One all-reduce into the 1-D ``flat`` (from ``src``, or in place when None), checked against
        the other ranks' ``sig``; returns ``flat``."""
        ce = self._chunk_elems(flat.dtype, op)

        def body(link):
            # job-wide facts (every rank takes the handshake or none): shared arrays, or cross-memory reads
            cma = 0 < self._cma_bytes <= flat.nbytes and not needs_wide_accumulator(flat.dtype, op)
            if (link is not None and self._direct is not None and flat.nbytes > DIRECT_ABOVE_BYTES
                    and (self._shared.active or cma)):
                found = self._shared.find(flat) if src is None else None
                if self._direct.direct(flat, found, op, link.seq, sig, link.deadline, abort=link.abort_now,
                                       on_timeout=link.timeout_error, src=src, cma=cma):
                    return flat
            if link is not None and self._fusion_takes(flat.nbytes):
                self._fusion.allreduce([flat if src is None else src], [flat], op, link.seq, sig, link.deadline,
                                       abort=link.abort_now, on_timeout=link.timeout_error)
                return flat
            if link is not None and self.hierarchical:
                return self._hierarchical_allreduce(link, flat, op, ce, src)
            return ring.allreduce(link or SINGLE, flat, op, ce, self.small_bytes, src=src)
        return self._run(sig, timeout, body)

    def shared_empty(self, shape: Tuple[int, ...], dtype: np.dtype, timeout=None) -> np.ndarray:
        """A new array in shared memory that every rank of this host maps (``shm_shared``); a collective:
        every rank calls it with the same shape and dtype, in the same order. In-place all-reduces of
        it (``out=`` the array itself, the same part of it on every rank) read the peers' values where
        they are. Private memory (``np.empty``) when the job does not share one host's memory or the
        segments cannot be made (on every rank alike)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self.size == 1 or not self._all_shm:
            return np.empty(shape, dtype)
        g = self.group
        wait = config.call_timeout(timeout, g.rendezvous_timeout, self.rank)
        with self._lock:
            if self._failed is not None:
                raise CollectiveError(f"the process group is unusable after an earlier error: {self._failed}",
                                      rank=self.rank, fix="shut down (tfcs.shutdown()) and restart the job")
            try:
                return self._shared_empty_locked(shape, dtype, nbytes, wait)
            except TfcsError as e:  # ranks may now disagree on what they hold: the group is done, as after
                self._fail(e, notify_peers=True)  # any failed collective
                raise

    def _make_direct_flags(self, timeout: float) -> Optional[str]:
        """Flag buffers of their own for the direct all-reduce (shared arrays, cross-memory reads) when the
        job has no shared all-reduce buffers: a collective step, tried once. Returns this rank's problem
        (``self._direct`` stays None on every rank alike) or None."""
        self._direct_tried = True
        self._direct, problem = shm_fusion.FusionBuffers.create(
            self.group.store, self.rank, self.size, [x.pid for x in self.group.workers], self.describe,
            DIRECT_FLAGS_BYTES, timeout, shared_memory.spin_seconds(self.size), prefix="shmdirect")
        return problem

    def _shared_empty_locked(self, shape, dtype, nbytes: int, wait: float) -> np.ndarray:
        g = self.group
        if not self._direct_tried:  # no shared all-reduce buffers (turned off, or they could not be made)
            problem = self._make_direct_flags(wait)
            if problem:
                log.warning("tf_commstrategy rank %d: shared arrays unavailable (%s); shared_empty hands out "
                            "private memory", self.rank, problem)
        if self._direct is None:  # every rank alike
            return np.empty(shape, dtype)
        u8 = self._shared.allocate(g.store, nbytes, f"shape={tuple(shape)} dtype={dtype}", wait)
        return np.empty(shape, dtype) if u8 is None else u8.view(dtype).reshape(shape)

    def _hierarchical_allreduce(self, link, flat, op: ReduceOp, ce: int, src):
        """All-reduce within this host, then among the hosts' leaders, then broadcast within the host.

        MEAN is summed all the way and divided once at the end (the host groups may differ in size).
        """
        wide = needs_wide_accumulator(flat.dtype, op)
        inner = ReduceOp.SUM if op is ReduceOp.MEAN else op
        work = flat
        if wide:  # float16 / bfloat16: accumulate in float32 through both reductions, round once
            work = (src if src is not None else flat).astype(np.float32)
            src = None
        ring.allreduce(link.on(self._host_ring) if self._host_ring.size > 1 else SINGLE, work, inner,
                       self._chunk_elems(work.dtype), src=src)
        if self._leader_ring is not None and self._leader_ring.size > 1:
            ring.allreduce(link.on(self._leader_ring), work, inner, self._chunk_elems(work.dtype))
        if self._host_ring.size > 1:
            ring.broadcast(link.on(self._host_ring, phase_id=3), work, 0, self._chunk_elems(work.dtype))
        if op is ReduceOp.MEAN:
            finish_mean(work, self.size)
        if wide:
            flat[...] = work
        return flat

    def reduce_scatter(self, buf: np.ndarray, op: ReduceOp, timeout=None) -> np.ndarray:
        if buf.ndim == 0:
            raise UnsupportedOperationError("reduce_scatter needs at least one dimension to split",
                                            rank=self.rank, fix="reshape the scalar to shape (1,)")
        sig = f"reduce_scatter op={op.value} dtype={buf.dtype} shape={tuple(buf.shape)}"
        flat = np.array(buf, copy=True, order="C").reshape(-1)
        rows = buf.shape[0]
        row_elems = int(np.prod(buf.shape[1:], dtype=np.int64))
        ce = self._chunk_elems(buf.dtype, op)

        def body(link):
            lo, hi = ring.reduce_scatter(link or SINGLE, flat, op, rows, row_elems, ce)
            row_bounds = ring.array_split_bounds(rows, self.size)  # the row count, also when rows are empty
            mine = row_bounds[self.rank + 1] - row_bounds[self.rank]
            return flat[lo:hi].reshape((mine,) + tuple(buf.shape[1:])).copy()
        return self._run(sig, timeout, body)

    def broadcast(self, buf: np.ndarray, root: int, timeout=None) -> np.ndarray:
        sig = f"broadcast root={root} dtype={buf.dtype} shape={tuple(buf.shape)}"
        flat = np.array(buf, copy=True, order="C").reshape(-1)
        ce = self._chunk_elems(buf.dtype)

        def body(link):
            return ring.broadcast(link or SINGLE, flat, root, ce).reshape(buf.shape)
        return self._run(sig, timeout, body)

    def allgather(self, buf: np.ndarray, timeout=None) -> np.ndarray:
        if buf.ndim == 0:
            buf = buf.reshape(1)
        trailing = tuple(buf.shape[1:])
        counts = self._allgather_counts(buf.shape[0], trailing, buf.dtype, timeout)
        row = int(np.prod(trailing, dtype=np.int64))
        elems = [c * row for c in counts]
        out = np.empty(sum(elems), dtype=buf.dtype)
        off = sum(elems[:self.rank])
        out[off:off + elems[self.rank]] = buf.reshape(-1)
        sig = f"allgather dtype={buf.dtype} trailing={trailing} rows={counts}"
        ce = self._chunk_elems(buf.dtype)

        def body(link):
            return ring.allgather(link or SINGLE, out, elems, ce).reshape((sum(counts),) + trailing)
        return self._run(sig, timeout, body)

    def _allgather_counts(self, rows: int, trailing, dtype, timeout) -> List[int]:
        mine = np.zeros(self.size, dtype=np.int64)
        mine[self.rank] = rows
        sig = f"allgather-sizes dtype={np.dtype(dtype)} trailing={trailing}"

        def body(link):
            if link is None:
                return mine
            return ring.allreduce(link, mine, ReduceOp.SUM, self._chunk_elems(np.int64))
        return [int(c) for c in self._run(sig, timeout, body)]

    def barrier(self, timeout=None) -> None:
        token = np.ones(1, dtype=np.int32)

        def body(link):
            if link is not None:
                ring.allreduce(link, token, ReduceOp.SUM, 1)
        self._run("barrier", timeout, body)

    def accepts(self, buf) -> bool:
        return isinstance(buf, np.ndarray)

    def stats(self) -> "HostStats":
        if self._fusion is not None:
            path = "shm-buffers" if self.size >= 3 else "ring (small: shm-buffers)"
        else:
            path = "hierarchical" if self.hierarchical else "ring"
        direct = self._direct
        return HostStats(collectives=self._seq, pending_messages=self.mailbox.pending(), busy_s=self._busy_s,
                         transport=self.transport, allreduce_path=path, shared_arrays=self._shared.active,
                         direct_allreduces=direct.direct_calls if direct is not None else 0,
                         cross_memory_bytes=self._cma_bytes,
                         cma_allreduces=direct.cma_calls if direct is not None else 0)

    def quiesce(self) -> None:
        """Stop watching the peers (shutdown has begun: peers going away is expected now)."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def close(self) -> None:
        self.quiesce()
        for p in self._probes.values():
            p.close()
        self._probes = {}
        for r in (self._ring, self._host_ring, self._leader_ring):
            if r is not None:
                r.close()
        self._ring = self._host_ring = self._leader_ring = None
        self._shared.close()
        shm_cma.forget_reader(self._cma_reader)
        self._cma_reader = None
        if self._direct is not None and self._direct is not self._fusion:
            self._direct.close()
        self._direct = None
        if self._fusion is not None:
            self._fusion.close()
            self._fusion = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        for srv in self._socket_servers.values():
            srv.stop()
        self._socket_servers = {}


register_backend("grpc", GrpcRingBackend)
