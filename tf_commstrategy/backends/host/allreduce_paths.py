"""The host backend's all-reduce algorithms, each behind one small interface, and the planner that picks
one per call.

Every path decides whether it takes a call from job-wide facts (the layout made at setup, the call's
size, dtype and op, and which arrays it reads and writes: every rank passes the same), so all ranks
pick the same path without a message. In the order the planner asks them:

* ``DirectAllReduce``: every rank on one host, in-place all-reduces of arrays from ``tfcs.shared_empty``
  or large ones of private arrays the peers can read (``shm_cma``): each rank reduces its segment
  reading the peers' arrays where they are; no copies through a transfer buffer. It may decline a call
  after its handshake (a rank whose array is not shared), on every rank alike.
* ``SharedBuffersAllReduce``: every rank on one host: through the shared all-reduce buffers
  (``shm_buffers``); from 3 ranks every size, with 2 ranks only the small one-round path.
* ``HierarchicalAllReduce``: several hosts with several ranks on some: within each host, among the
  hosts' first ranks, then a broadcast within each host.
* ``RingAllReduce``: everything else: reduce-scatter and all-gather around the ring (``core.ring``),
  small buffers by one all-gather pass.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol

import numpy as np

from ...core import ring
from ...core.ring import SINGLE
from ...core.reduce_ops import ReduceOp, finish_mean, needs_wide_accumulator
from . import shm_direct
from .layout import DIRECT_ABOVE_BYTES, HostLayout


class AllReducePath(Protocol):
    """One all-reduce algorithm of the host backend.

    Attributes:
      name: what ``HostStats.allreduces_by_path`` calls it.
      narrows_chunks: it runs a compressed all-reduce on the float32 / float64 buffer itself, narrowing
        chunk by chunk as they cross its links (the others get a narrowed copy; ``AllReducePlanner``).
    """

    name: str
    narrows_chunks: bool = False

    def takes(self, flat: np.ndarray, op: ReduceOp, in_place: bool) -> bool:
        """Whether this path runs an all-reduce of ``flat`` (job-wide facts only: every rank agrees)."""

    def run(self, link, flat: np.ndarray, op: ReduceOp, src: Optional[np.ndarray], sig: str, wide: bool) -> bool:
        """All-reduce into ``flat`` (from ``src``, or in place when None); False when it declined (on
        every rank alike) and the next path must run it. ``wide``: float16 / bfloat16 partial sums that
        cross a link travel as float32 (False: in the buffer's dtype, a compressed all-reduce); paths
        that add up in shared memory accumulate in float32 either way."""


class DirectAllReduce:
    narrows_chunks = False
    name = "direct"

    def __init__(self, layout: HostLayout, shared):
        self._layout, self._shared = layout, shared

    def _cma(self, flat: np.ndarray, op: ReduceOp) -> bool:
        return 0 < self._layout.cma_bytes <= flat.nbytes and not needs_wide_accumulator(flat.dtype, op)

    def takes(self, flat, op, in_place) -> bool:
        return (self._layout.direct is not None and flat.nbytes > DIRECT_ABOVE_BYTES
                and (self._shared.active or self._cma(flat, op)))

    def run(self, link, flat, op, src, sig, wide) -> bool:
        found = self._shared.find(flat) if src is None else None
        return shm_direct.allreduce(self._layout.direct, flat, found, op, link.seq, sig, link.deadline,
                                    abort=link.abort_now, on_timeout=link.timeout_error, src=src,
                                    cma=self._cma(flat, op))


class SharedBuffersAllReduce:
    narrows_chunks = False
    name = "shm-buffers"

    def __init__(self, layout: HostLayout):
        self._layout = layout

    def takes(self, flat, op, in_place) -> bool:
        f = self._layout.buffers
        return f is not None and (self._layout.size >= 3 or 0 < flat.nbytes <= f.small_bytes)

    def run(self, link, flat, op, src, sig, wide) -> bool:
        self._layout.buffers.allreduce([flat if src is None else src], [flat], op, link.seq, sig, link.deadline,
                                      abort=link.abort_now, on_timeout=link.timeout_error)
        return True


class HierarchicalAllReduce:
    narrows_chunks = False
    name = "hierarchical"

    def __init__(self, layout: HostLayout, chunk_elems):
        self._layout, self._chunk_elems = layout, chunk_elems

    def takes(self, flat, op, in_place) -> bool:
        return self._layout.hierarchical

    def run(self, link, flat, op, src, sig, wide) -> bool:
        """MEAN is summed all the way and divided once at the end (the host groups may differ in size)."""
        host, leaders = self._layout.host_ring, self._layout.leader_ring
        wide = wide and needs_wide_accumulator(flat.dtype, op)
        inner = ReduceOp.SUM if op is ReduceOp.MEAN else op
        work = flat
        if wide:  # float16 / bfloat16: accumulate in float32 through both reductions, round once
            work = (src if src is not None else flat).astype(np.float32)
            src = None
        ce = self._chunk_elems(work.dtype)
        # work is float32 already when widened; otherwise its partials travel as they are
        ring.allreduce(link.on(host) if host.size > 1 else SINGLE, work, inner, ce, src=src, wide=False)
        if leaders is not None and leaders.size > 1:
            ring.allreduce(link.on(leaders), work, inner, ce, wide=False)
        if host.size > 1:
            ring.broadcast(link.on(host, phase_id=3), work, 0, ce)
        if op is ReduceOp.MEAN:
            finish_mean(work, self._layout.size)
        if wide:
            flat[...] = work
        return True


class RingAllReduce:
    name = "ring"
    narrows_chunks = True

    def __init__(self, layout: HostLayout, chunk_elems):
        self._layout, self._chunk_elems = layout, chunk_elems

    def takes(self, flat, op, in_place) -> bool:
        return True

    def run(self, link, flat, op, src, sig, wide, wire=None) -> bool:
        """``wire``: a compressed call's dtype on the links (``flat`` stays float32 / float64)."""
        ce = self._chunk_elems(wire) if wire is not None else self._chunk_elems(flat.dtype, op if wide else None)
        ring.allreduce(link or SINGLE, flat, op, ce, self._layout.small_bytes, src=src, wide=wide, wire=wire)
        return True


class AllReducePlanner:
    """Picks the path of each all-reduce and counts which ran (``HostStats.allreduces_by_path``).

    Args:
      layout: what the backend set up.
      shared: the shared arrays of ``tfcs.shared_empty`` (``shm_shared.SharedArrays``).
      chunk_elems: ``chunk_elems(dtype, op=None)``: elements per ring chunk.
    """

    def __init__(self, layout: HostLayout, shared, chunk_elems):
        self._ring = RingAllReduce(layout, chunk_elems)
        self.paths: List[AllReducePath] = [DirectAllReduce(layout, shared), SharedBuffersAllReduce(layout),
                                           HierarchicalAllReduce(layout, chunk_elems), self._ring]
        self.calls: Dict[str, int] = {}

    def run(self, link, flat: np.ndarray, op: ReduceOp, src: Optional[np.ndarray], sig: str,
            wire: Optional[np.dtype] = None) -> np.ndarray:
        """All-reduce into ``flat`` on the first path that takes it (the ring alone in a job of one).

        ``wire``: a compressed call (``core.compression``): the ring narrows chunk by chunk; the other
        paths reduce a narrowed copy, its partial sums in the narrow dtype where they cross a link."""
        paths = self.paths if link is not None else (self._ring,)
        for path in paths:
            if path.takes(flat, op, src is None) and self._run(path, link, flat, op, src, sig, wire):
                self.calls[path.name] = self.calls.get(path.name, 0) + 1
                return flat
        raise AssertionError("the ring takes every all-reduce")  # pragma: no cover

    @staticmethod
    def _run(path: AllReducePath, link, flat, op, src, sig, wire) -> bool:
        if wire is None:
            return path.run(link, flat, op, src, sig, True)
        if path.narrows_chunks:
            return path.run(link, flat, op, src, sig, False, wire=wire)
        narrow = (flat if src is None else src).astype(wire)
        if not path.run(link, narrow, op, None, sig, False):
            return False
        flat[...] = narrow
        return True
