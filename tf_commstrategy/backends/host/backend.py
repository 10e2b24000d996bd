"""The host backend ("grpc"): ring collectives over per-pair data paths, plus the one-host
shared-memory algorithms; numpy in, numpy out.

``HostBackend`` validates a call, names it (its signature, checked against every peer's), and hands it
to the ``CollectiveRunner`` (numbering, deadline, failure); all-reduces go to the ``AllReducePlanner``,
which picks one of the algorithms of ``allreduce_paths``; the other collectives run the ring algorithms
of ``core.ring``. What was set up once (rings, servers, shared memory) is the ``HostLayout``; the other
ranks, their heartbeats and the abort message are ``Peers``. The registry name stays "grpc": gRPC is the
control plane and the data path that always works.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Optional, Tuple

import numpy as np

from ... import config
from ...core import compression as compression_mod
from ...core import ring
from ...core.ring import SINGLE
from ...core.backend import Backend, BackendStats, Capabilities, check_splits, register_backend
from ...core.reduce_ops import ReduceOp, needs_wide_accumulator
from ...errors import UnsupportedOperationError
from . import shm_shared, wire
from .allreduce_paths import AllReducePlanner
from .layout import HostLayout
from .peers import Peers
from .runner import CollectiveRunner

log = logging.getLogger("tf_commstrategy")


@dataclasses.dataclass(frozen=True)
class HostStats(BackendStats):
    """What the host backend has done, and which paths it took.

    Attributes:
      pending_messages: frames received for collectives this rank has not entered yet.
      busy_s: seconds spent inside collectives.
      transport: the ring's data path ("shm", "unix", "tcp", "grpc", or a mix such as "shm+tcp").
      allreduce_path: the path of a large all-reduce: "ring", "hierarchical", "shm-buffers" (3+ ranks
        on one host), "ring (small: shm-buffers)" (2 ranks on one host: small ones take the buffers).
      allreduces_by_path: how many all-reduces each path ran ("direct", "shm-buffers", "hierarchical",
        "ring").
      shared_arrays: whether this rank holds arrays of ``shared_empty`` now.
      direct_allreduces: in-place all-reduces of shared arrays that read the peers' arrays where they are.
      cma_allreduces: all-reduces that read the peers' private arrays by cross-memory reads.
      cross_memory_bytes: the size from which all-reduces read the peers' arrays (0: never).
      bytes_sent: the bytes this rank's ring links carried to its right neighbours (shared memory, raw
        sockets or gRPC); the shared all-reduce buffers and direct reads of the peers' arrays are not links.
    """

    pending_messages: int = 0
    busy_s: float = 0.0
    transport: str = ""
    allreduce_path: str = ""
    allreduces_by_path: Dict[str, int] = dataclasses.field(default_factory=dict)
    shared_arrays: bool = False
    direct_allreduces: int = 0
    cma_allreduces: int = 0
    cross_memory_bytes: int = 0
    bytes_sent: int = 0


class HostBackend(Backend):
    """Collectives of numpy arrays between the job's processes. One instance per process group.

    Args:
      group: the process group (``core.backend.Group``).
    """

    name = "grpc"
    capabilities = Capabilities(out_arrays=True, shared_arrays=True)

    def __init__(self, group):
        self.group, self.rank, self.size = group, group.rank, group.size
        self.mailbox = wire.Mailbox()
        self.mailbox.on_fail = group.failed  # layers above learn of the group's failure
        self.mailbox.on_reject = lambda what: log.warning(
            "tf_commstrategy rank %d: dropped a data frame that names no current collective (%s); further "
            "ones are not logged", self.rank, what)
        self.peers = Peers(group)
        self.runner = CollectiveRunner(self)
        self.layout = HostLayout(self)
        self._shared = shm_shared.SharedArrays(self.rank, self.size)
        self._planner = AllReducePlanner(self.layout, self._shared, self._chunk_elems)
        self._allreduce_sigs: dict = {}
        self.collective_bytes = 0  # HostStats.collective_bytes
        self.bytes_sent = 0        # HostStats.bytes_sent: CollectiveLink.send adds to it
        if self.size > 1:
            try:
                self.layout.connect()
                self.peers.watch(self.layout.neighbours(), lambda rank, error: self.runner.fail(error),
                                 self.mailbox.is_gone)
            except BaseException:  # no server, socket or shared-memory segment outlives a failed setup
                self.close()
                raise

    # -- what the rings, links and servers ask of the backend ------------------------------------------
    @property
    def chunk_bytes(self) -> int:
        return self.layout.chunk_bytes

    @property
    def transport(self) -> str:
        return self.layout.transport

    @property
    def hierarchical(self) -> bool:
        return self.layout.hierarchical

    @property
    def flags(self):
        """The shared all-reduce buffers' flags (every rank on one host), whose words tell which collective
        each rank has entered; else None."""
        return self.layout.direct

    def socket_server(self, kind: str):
        return self.layout.socket_server(kind)

    def address_of(self, rank: int) -> str:
        return self.peers.address_of(rank)

    def describe(self, rank: int) -> str:
        return self.peers.describe(rank)

    def arrivals(self, seq: int, waited_on: int):
        return self.peers.arrivals(seq, waited_on)

    def progress(self) -> dict:
        """What this rank's data server tells a peer that asks how far it got."""
        return {"started": self.runner.seq, "failed": self.runner.failed is not None}

    def serves_transport(self, name: str) -> bool:
        """Whether a call that asks for transport ``name`` runs on the links this job set up: "auto",
        the transport the job asked for, or the one kind that every link of the job's ring was planned
        with ("shm" when all ranks share a host's memory). Decided from job-wide facts only, so every
        rank gives the same answer (a rank's own links may differ from its neighbours')."""
        n = config.parse_transport(name)
        return n in ("auto", config.parse_transport(self.group.transport)) or self.layout.planned_kinds == {n}

    def failure(self) -> Optional[BaseException]:
        return self.runner.failure()

    def abort(self, error: BaseException) -> None:
        self.runner.fail(error)

    def _chunk_elems(self, dtype, op: Optional[ReduceOp] = None) -> int:
        """Elements per chunk; float16 / bfloat16 reductions travel as float32 partials, so they are
        counted at 4 bytes (a chunk on the wire never exceeds ``chunk_bytes``)."""
        on_wire = np.float32 if op is not None and needs_wide_accumulator(np.dtype(dtype), op) else dtype
        return max(1, self.layout.chunk_bytes // max(np.dtype(dtype).itemsize, np.dtype(on_wire).itemsize))

    # -- collectives -----------------------------------------------------------------------------------
    def allreduce(self, buf: np.ndarray, op: ReduceOp, timeout=None, out: Optional[np.ndarray] = None, *,
                  compression: str = "none") -> np.ndarray:
        """``out`` (C-contiguous, same shape and dtype; may be ``buf``: in place) receives the result;
        without it a new array does. ``buf`` itself is only read unless it is ``out``. With compression
        (``core.compression``) the values travel narrowed, their partial sums rounded to the wire dtype
        at every ring step, and ``out`` receives the result widened back (``AllReducePlanner.run``)."""
        wire = compression_mod.wire_dtype(compression, buf.dtype, op)
        sig = self._allreduce_sig(op, buf.dtype, buf.shape, wire)
        src = np.ascontiguousarray(buf).reshape(-1)
        flat = np.empty_like(src) if out is None else self._out_array(buf, out)
        if flat is src or (out is not None and np.shares_memory(flat, src)):
            if flat.__array_interface__["data"][0] != src.__array_interface__["data"][0]:
                raise UnsupportedOperationError(
                    "out= overlaps the input without being it (e.g. x[:-1] into x[1:]): the reduction would "
                    "read values it has already overwritten", rank=self.rank,
                    fix="pass out=x (in place) or an array that does not overlap x")
            src = None  # in place
        self.collective_bytes += flat.size * (wire or flat.dtype).itemsize
        result = self.runner.run(sig, timeout, lambda link: self._planner.run(link, flat, op, src, sig, wire))
        return out if out is not None else result.reshape(buf.shape)

    def _allreduce_sig(self, op: ReduceOp, dtype, shape, wire) -> str:
        key = (op, dtype, shape, wire)
        sig = self._allreduce_sigs.get(key)
        if sig is None:  # formatting a dtype's name costs more than the small all-reduce's own bookkeeping
            if len(self._allreduce_sigs) > 256:
                self._allreduce_sigs.clear()
            sig = f"allreduce op={op.value} dtype={dtype} shape={tuple(shape)}" + (f" wire={wire}" if wire else "")
            self._allreduce_sigs[key] = sig
        return sig

    def _out_array(self, buf: np.ndarray, out: np.ndarray) -> np.ndarray:
        if out.shape != buf.shape or out.dtype != buf.dtype or not out.flags.c_contiguous or not out.flags.writeable:
            raise UnsupportedOperationError(
                f"out= must be a writeable C-contiguous array of shape {buf.shape} and dtype {buf.dtype}; "
                f"got shape {out.shape}, dtype {out.dtype}" + ("" if out.flags.writeable else ", read-only"),
                rank=self.rank, fix="pass out=np.empty_like(x) or out=x (in place, x writeable)")
        return out.reshape(-1)

    def shared_empty(self, shape: Tuple[int, ...], dtype: np.dtype, timeout=None) -> np.ndarray:
        """A new array in shared memory that every rank of this host maps (``shm_shared``); a collective:
        every rank calls it with the same shape and dtype, in the same order. In-place all-reduces of
        it (``out=`` the array itself, the same part of it on every rank) read the peers' values where
        they are. Private memory (``np.empty``) when the job does not share one host's memory or the
        segments cannot be made (on every rank alike)."""
        if self.size == 1 or not self.layout.all_shm:
            return np.empty(shape, dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        wait = config.call_timeout(timeout, self.group.rendezvous_timeout, self.rank)
        return self.runner.run_setup_step(lambda: self._allocate_shared(shape, dtype, nbytes, wait))

    def _allocate_shared(self, shape, dtype, nbytes: int, wait: float) -> np.ndarray:
        if not self.layout.direct_tried:  # no shared all-reduce buffers (turned off, or they could not be made)
            problem = self.layout.make_direct_flags(wait)
            if problem:
                log.warning("tf_commstrategy rank %d: shared arrays unavailable (%s); shared_empty hands out "
                            "private memory", self.rank, problem)
        if self.layout.direct is None:  # every rank alike
            return np.empty(shape, dtype)
        u8 = self._shared.allocate(self.group.store, nbytes, f"shape={tuple(shape)} dtype={dtype}", wait)
        return np.empty(shape, dtype) if u8 is None else u8.view(dtype).reshape(shape)

    def reduce_scatter(self, buf: np.ndarray, op: ReduceOp, timeout=None) -> np.ndarray:
        if buf.ndim == 0:
            raise UnsupportedOperationError("reduce_scatter needs at least one dimension to split",
                                            rank=self.rank, fix="reshape the scalar to shape (1,)")
        sig = f"reduce_scatter op={op.value} dtype={buf.dtype} shape={tuple(buf.shape)}"
        flat = np.array(buf, copy=True, order="C").reshape(-1)
        self.collective_bytes += flat.nbytes
        rows = buf.shape[0]
        row_elems = int(np.prod(buf.shape[1:], dtype=np.int64))
        ce = self._chunk_elems(buf.dtype, op)

        def body(link):
            lo, hi = ring.reduce_scatter(link or SINGLE, flat, op, rows, row_elems, ce)
            row_bounds = ring.array_split_bounds(rows, self.size)  # the row count, also when rows are empty
            mine = row_bounds[self.rank + 1] - row_bounds[self.rank]
            return flat[lo:hi].reshape((mine,) + tuple(buf.shape[1:])).copy()
        return self.runner.run(sig, timeout, body)

    def broadcast(self, buf: np.ndarray, root: int, timeout=None) -> np.ndarray:
        sig = f"broadcast root={root} dtype={buf.dtype} shape={tuple(buf.shape)}"
        flat = np.array(buf, copy=True, order="C").reshape(-1)
        self.collective_bytes += flat.nbytes
        ce = self._chunk_elems(buf.dtype)

        def body(link):
            return ring.broadcast(link or SINGLE, flat, root, ce).reshape(buf.shape)
        return self.runner.run(sig, timeout, body)

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
        self.collective_bytes += buf.nbytes
        sig = f"allgather dtype={buf.dtype} trailing={trailing} rows={counts}"
        ce = self._chunk_elems(buf.dtype)

        def body(link):
            return ring.allgather(link or SINGLE, out, elems, ce).reshape((sum(counts),) + trailing)
        return self.runner.run(sig, timeout, body)

    def _allgather_counts(self, rows: int, trailing, dtype, timeout) -> List[int]:
        mine = np.zeros(self.size, dtype=np.int64)
        mine[self.rank] = rows
        sig = f"allgather-sizes dtype={np.dtype(dtype)} trailing={trailing}"

        def body(link):
            if link is None:
                return mine
            return ring.allreduce(link, mine, ReduceOp.SUM, self._chunk_elems(np.int64))
        return [int(c) for c in self.runner.run(sig, timeout, body)]

    def alltoall(self, buf: np.ndarray, splits: Optional[List[int]] = None, timeout=None):
        """Blocks of rows passed along the ring (``ring.alltoall``); the split table is gathered first."""
        table = self._split_table(check_splits(buf, splits, self.size, self.rank), tuple(buf.shape[1:]),
                                  buf.dtype, timeout)
        row = int(np.prod(buf.shape[1:], dtype=np.int64))
        sig = f"alltoall dtype={buf.dtype} trailing={tuple(buf.shape[1:])} rows={table.tolist()}"
        flat = np.ascontiguousarray(buf).reshape(-1)
        self.collective_bytes += flat.nbytes
        ce = self._chunk_elems(buf.dtype)
        received = table[:, self.rank]

        def body(link):
            out = ring.alltoall(link or SINGLE, flat, (table * row).tolist(), ce)
            return out.reshape((int(received.sum()),) + tuple(buf.shape[1:]))
        return self.runner.run(sig, timeout, body), [int(c) for c in received]

    def _split_table(self, splits: List[int], trailing, dtype, timeout) -> np.ndarray:
        """Every rank's splits, row o = rank o's (one all-reduce of a table each rank fills one row of)."""
        mine = np.zeros((self.size, self.size), dtype=np.int64)
        mine[self.rank] = splits
        sig = f"alltoall-splits dtype={np.dtype(dtype)} trailing={trailing}"

        def body(link):
            if link is None:
                return mine
            return ring.allreduce(link, mine.reshape(-1), ReduceOp.SUM, self._chunk_elems(np.int64))
        return self.runner.run(sig, timeout, body).reshape(self.size, self.size)

    def barrier(self, timeout=None) -> None:
        token = np.ones(1, dtype=np.int32)

        def body(link):
            if link is not None:
                ring.allreduce(link, token, ReduceOp.SUM, 1)
        self.runner.run("barrier", timeout, body)

    def accepts(self, buf) -> bool:
        return isinstance(buf, np.ndarray)

    def stats(self) -> HostStats:
        layout = self.layout
        if layout.buffers is not None:
            path = "shm-buffers" if self.size >= 3 else "ring (small: shm-buffers)"
        else:
            path = "hierarchical" if layout.hierarchical else "ring"
        direct = layout.direct
        return HostStats(collectives=self.runner.seq, pending_messages=self.mailbox.pending(),
                         busy_s=self.runner.busy_s, transport=layout.transport, allreduce_path=path,
                         allreduces_by_path=dict(self._planner.calls), shared_arrays=self._shared.active,
                         direct_allreduces=direct.direct_calls if direct is not None else 0,
                         cross_memory_bytes=layout.cma_bytes,
                         cma_allreduces=direct.cma_calls if direct is not None else 0,
                         collective_bytes=self.collective_bytes, bytes_sent=self.bytes_sent)

    def quiesce(self) -> None:
        """Stop watching the peers (shutdown has begun: peers going away is expected now)."""
        self.peers.quiesce()

    def close(self) -> None:
        self.peers.close()
        self._shared.close()
        self.layout.close()


register_backend("grpc", HostBackend)
