"""Arrays that live in shared memory, one per rank, each mapped by every other rank of the host
(``tfcs.shared_empty``): the all-reduce then reads the peers' values where they are.

An all-reduce of private arrays has to copy every rank's input somewhere the peers can read it and
copy the result back out (the ring's shm links and the shared all-reduce buffers both do). When the
array the caller reduces in place already lives in shared memory, and every rank passes the same
allocation, ``SharedBuffers.direct`` needs neither copy: rank r reduces the r-th segment of its own
array with the r-th segments of the peers' arrays, then copies the other segments from their owners
(with 2 ranks: 2.5 bytes of memory traffic per input byte instead of the ring's 4.5).

Allocation is collective, like TF's collectives and like torch's symmetric memory or MPI's
``MPI_Win_allocate_shared``: every rank calls ``allocate`` for the same shape and dtype in the same
order. Each rank creates its segment (mode 0600, an unguessable name, ``shared_memory.Segment``), publishes
the name over the job's authenticated store, maps every peer's, and unlinks its own once every rank has
mapped it: nothing stays in /dev/shm, even after a kill -9 (a rank killed before unlinking leaves a
segment that the stale-segment sweep of the next start, or tfcs-run, removes). The memory of an
allocation stays mapped until the process group shuts down: allocate buffers once and reuse them.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import numpy as np

from ...errors import CollectiveMismatchError
from ...core import shared_memory
from ...core.shared_memory import Segment

log = logging.getLogger("tf_commstrategy")


class SharedAllocation:
    """One collective allocation: this rank's segment and every peer's (all mapped here)."""

    def __init__(self, ident: int, segs: dict, nbytes: int, rank: int):
        self.ident, self.nbytes = ident, nbytes
        self._segs = segs
        self.start = segs[rank].addr
        self.views = {q: s.u8[:nbytes] for q, s in segs.items()}  # uint8, every rank's data

    def close(self) -> None:
        self.views = {}
        for s in self._segs.values():
            s.close()
        self._segs = {}


class SharedArrays:
    """This rank's collective allocations, and which of them a given array lies in."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self._allocs: List[SharedAllocation] = []
        self.count = 0  # collective allocations so far (failed ones too): the same on every rank

    def allocate(self, store, nbytes: int, what: str, timeout: float) -> Optional[np.ndarray]:
        """Every rank calls this with the same ``nbytes`` at the same point of its program.

        Returns:
          this rank's uint8 array of ``nbytes`` in its segment, or None on every rank alike when any
          rank could not create or map one (the caller then hands out private memory).

        Raises:
          CollectiveMismatchError: the ranks asked for different sizes.
          RendezvousError / CollectiveTimeoutError: from the store (a rank missing past ``timeout``).
        """
        k = self.count
        self.count += 1
        seg, why = None, shared_memory.available()
        if why is None:
            try:
                seg = Segment.create(max(nbytes, 1), "shared")
            except OSError as e:
                why = (f"cannot reserve {nbytes >> 20} MiB in {shared_memory.SHM_DIR} ({e}; "
                       f"{shared_memory.free_mib()} MiB free)")

        def same_size(theirs):
            for q, t in theirs.items():
                if int(t["nbytes"]) != nbytes:
                    raise CollectiveMismatchError(
                        f"shared allocation #{k} mismatch: this rank asked for {what} ({nbytes} bytes) but rank "
                        f"{q} asked for {t['what']} ({t['nbytes']} bytes)", rank=self.rank, seq=k,
                        local_signature=what, remote_signature=str(t["what"]), remote_rank=q,
                        fix="every rank must call shared_empty with the same shape and dtype in the same order")
        segs, why, own, _ = shared_memory.map_all_ranks(store, f"shared/{k}", self.rank, self.size, seg, why,
                                                     {"nbytes": nbytes, "what": what}, timeout, check=same_size)
        if why is not None:
            if own or self.rank == 0:
                log.warning("tf_commstrategy rank %d: shared_empty(%s) hands out private memory (%s); all-reduces "
                            "of it copy through the ring as usual", self.rank, what, why)
            return None
        segs[self.rank] = seg
        self._allocs.append(SharedAllocation(k, segs, nbytes, self.rank))
        return seg.u8[:nbytes]

    @property
    def active(self) -> bool:
        """Whether this job holds shared arrays (the same answer on every rank)."""
        return bool(self._allocs)

    def find(self, arr: np.ndarray) -> Optional[Tuple[SharedAllocation, int]]:
        """``(allocation, byte offset)`` when the C-contiguous ``arr`` lies wholly in one of this rank's
        allocations, else None."""
        if not self._allocs:
            return None
        addr = arr.__array_interface__["data"][0]
        for a in self._allocs:
            off = addr - a.start
            if 0 <= off and off + arr.nbytes <= a.nbytes:
                return a, off
        return None

    def close(self) -> None:
        for a in self._allocs:
            a.close()
        self._allocs = []
