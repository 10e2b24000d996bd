"""The direct all-reduce: every rank on one host reads its peers' arrays where they are, coordinated
through the flags of the shared all-reduce buffers (``shm_buffers``).

Two ways to read a peer's array: through the ranks' shared arrays (``shm_shared``) when every rank
passes the same part of the same allocation in place, else by cross-memory attach (``shm_cma``) when
the backend decided so for the call. Every rank calls ``allreduce`` for the same collective, with the
same ``cma`` (decided from job-wide facts).

One generation of the buffers: each rank publishes its header (collective number, elements,
signature, which allocation and offset its array is, or none, and its arrays' addresses) and
``ready``. Then rank r reduces the r-th segment (``even_bounds``) of its array with the peers' r-th
segments (read where they are, or copied out of the peers' address spaces a buffer at a time),
publishes ``reduced``, copies every other segment q from rank q's array once q has published
``reduced``, publishes ``done`` and waits for every peer's ``done`` (they have stopped reading its
arrays: they are the caller's again). When neither way applies each rank publishes ``done`` after
reading the headers and the caller runs its usual path.
"""

from __future__ import annotations

import errno
import time
from typing import Optional

import numpy as np

from ...core.reduce_ops import ReduceOp, combine_into, combine_to, finish_mean, needs_wide_accumulator
from ...core.ring import even_bounds
from ...core.shared_memory import fence, pid_alive, reported_cause
from ...errors import CollectiveError
from . import shm_cma
from .shm_layout import CMA_AT, DIRECT, DIRECT_PIECE, DONE, INFO, LAST_WHOLE, READY, REDUCED, SIG_AT, SIG_MAX

LOST_GRACE_S = 1.0            # a failed cross-memory read: how long the peer may take to disappear
CMA_CHUNK_BYTES = 256 << 10   # a peer's segment is read into a buffer of this size and reduced from there:
                              # small enough to stay in the CPU's cache between the two


def allreduce(bufs, arr: np.ndarray, found, op: ReduceOp, seq: int, sig: str, deadline: float, abort=None,
              on_timeout=None, src: Optional[np.ndarray] = None, cma: bool = False) -> bool:
    """An all-reduce into ``arr`` that reads the peers' arrays where they are (module docstring).

    Args:
      bufs: the shared all-reduce buffers (``shm_buffers.SharedBuffers``), whose flags coordinate it.
      arr: this rank's 1-D C-contiguous output array (the input too when ``src`` is None).
      found: ``(SharedAllocation, byte offset)`` of ``arr`` when in place, or None (a private array).
      op, seq, sig, deadline, abort, on_timeout: as in ``SharedBuffers.allreduce``.
      src: the input when out of place (same size and dtype as ``arr``; only read).
      cma: whether the job reads private arrays by cross-memory attach for this call (every rank
        could read every peer at setup, the size is above the threshold, no float32 accumulator).

    Returns:
      True when ``arr`` holds the result; False when neither way applies (``arr`` untouched).

    Raises:
      CollectiveMismatchError, PeerLostError, CollectiveTimeoutError: as in ``SharedBuffers.allreduce``.
      CollectiveError: a peer's memory could not be read (it was readable at setup).
    """
    bufs.current = (seq, sig)
    if on_timeout is None:
        on_timeout = bufs.default_timeout(seq, sig)
    g = bufs.gen + 1
    shared, alloc, off = _handshake(bufs, g, arr, found, seq, sig, deadline, abort, on_timeout, src)
    mine = bufs.ctl[bufs.rank]
    if not shared and not cma:
        fence()
        mine[DONE] = g  # my reads of the headers are over
        bufs.ring_peers()
        return False
    r, W, dtype = bufs.rank, bufs.size, arr.dtype
    b = even_bounds(arr.size, W)
    if shared:
        theirs = {q: alloc.views[q][off:off + arr.nbytes].view(dtype) for q in bufs.peers}
        bufs.reduce_segment(arr[b[r]:b[r + 1]], [theirs[q][b[r]:b[r + 1]] for q in bufs.peers], op,
                            needs_wide_accumulator(dtype, op))
    else:
        addrs = {q: (int(bufs.ctl[q][CMA_AT]), int(bufs.ctl[q][CMA_AT + 1])) for q in bufs.peers}
        _reduce_segment_cma(bufs, arr, src, b[r], b[r + 1], addrs, op, abort)
    fence()
    mine[REDUCED] = g
    bufs.ring_peers()
    for k in range(1, W):
        q = (r + k) % W
        bufs.wait(REDUCED, g, (q,), deadline, abort, on_timeout)
        if shared:
            arr[b[q]:b[q + 1]] = theirs[q][b[q]:b[q + 1]]
        else:
            _read_peer(bufs, q, addrs[q][1] + b[q] * dtype.itemsize, arr[b[q]:b[q + 1]], abort)
    fence()  # off x86: my reads of the peers' arrays come before the word that lets them write again
    mine[DONE] = g
    bufs.ring_peers()
    bufs.wait(DONE, g, bufs.peers, deadline, abort, on_timeout)
    if shared:
        bufs.direct_calls += 1
    else:
        bufs.cma_calls += 1
    return True


def _handshake(bufs, g: int, arr: np.ndarray, found, seq: int, sig: str, deadline: float, abort, on_timeout,
               src: Optional[np.ndarray]):
    """Publish this rank's header for generation ``g`` and read every peer's: (whether every rank passed
    the same part of the same shared allocation in place, the allocation, the offset)."""
    r, n = bufs.rank, arr.size
    sig_b = sig.encode()[:SIG_MAX]
    mine = bufs.ctl[r]
    # the peers have read my last header (a large piece's is read after its ready)
    bufs.wait(DONE, g - 1, bufs.peers, deadline, abort, on_timeout)
    alloc, off = found if found is not None and src is None else (None, 0)
    ident = alloc.ident + 1 if alloc is not None else 0
    mine[INFO:INFO + 4] = (seq, DIRECT_PIECE, n, len(sig_b))
    mine[DIRECT:DIRECT + 3] = (ident, off, seq + 1)
    mine[CMA_AT:CMA_AT + 2] = ((arr if src is None else src).ctypes.data, arr.ctypes.data)
    bufs.segs[r].mm[SIG_AT:SIG_AT + len(sig_b)] = sig_b
    mine[LAST_WHOLE] = 1  # the next one-round generation waits for this one's done, not the one before
    fence()
    mine[READY] = g
    bufs.ring_peers()
    bufs.wait(READY, g, bufs.peers, deadline, abort, on_timeout)
    shared = alloc is not None
    for q in bufs.peers:
        bufs.entries.check(q, seq, DIRECT_PIECE, n, sig_b, sig)
        if tuple(int(x) for x in bufs.ctl[q][DIRECT:DIRECT + 3]) != (ident, off, seq + 1):
            shared = False
    return shared, alloc, off


def _reduce_segment_cma(bufs, arr: np.ndarray, src: Optional[np.ndarray], s0: int, s1: int, addrs: dict,
                        op: ReduceOp, abort) -> None:
    """``arr[s0:s1]`` = the reduction of every rank's input there: mine (``src``, or ``arr`` in place)
    combined with the peers' in rank order, read out of their address spaces a buffer at a time."""
    isz = arr.dtype.itemsize
    if bufs.cma_tmp is None:
        bufs.cma_tmp = np.empty(CMA_CHUNK_BYTES, np.uint8)
    step = CMA_CHUNK_BYTES // isz
    tmp = bufs.cma_tmp[:step * isz].view(arr.dtype)
    for a in range(s0, s1, step):
        e = min(a + step, s1)
        out, part = arr[a:e], tmp[:e - a]
        for i, q in enumerate(bufs.peers):
            _read_peer(bufs, q, addrs[q][0] + a * isz, part, abort)
            if i == 0 and src is not None:
                combine_to(out, src[a:e], part, op)
            else:
                combine_into(out, part, op)
        if op is ReduceOp.MEAN:
            finish_mean(out, bufs.size)


def _read_peer(bufs, q: int, addr: int, into: np.ndarray, abort) -> None:
    pid = bufs.pids[q]
    try:
        shm_cma.read_array(pid, addr, into)
    except OSError as e:
        # A killed process loses its memory before it turns into a zombie: reads fail with ESRCH
        # while its pid still looks alive, so ESRCH means lost too, and any other failure gets a
        # moment for the process to disappear before it is blamed on the read
        end = time.monotonic() + LOST_GRACE_S
        while e.errno != errno.ESRCH and pid_alive(pid) and time.monotonic() < end:
            time.sleep(0.01)
        if e.errno == errno.ESRCH or not pid_alive(pid):
            raise reported_cause(bufs.lost(q), abort) from e
        raise reported_cause(CollectiveError(
            f"rank {bufs.rank} could not read rank {q}'s array ({into.nbytes} bytes at {addr:#x} in pid "
            f"{pid}) during an all-reduce: {e}; it could at setup", rank=bufs.rank,
            fix="set TFCS_SHM_CMA=0 to take the ring instead, and report this"), abort) from e
