"""All-reduce through shared buffers when every rank of the job shares one host's memory (no ring).

Each rank owns one *fusion segment* in ``/dev/shm``: a header page and a data area of ``capacity``
bytes, mapped by every other rank of the job. An all-reduce moves through it in pieces of at most
``capacity`` bytes; piece ``g`` (a generation number that every rank counts the same way) runs:

1. wait until every peer's ``done`` >= g - 1 (it has finished reading my data area's last piece);
2. copy my input (one array, or several read one after the other: a fused gradient list needs no
   concatenation first) into my data area; write the piece's header (collective number, piece,
   elements, signature); publish ``ready`` = g and wake the peers;
3. wait until every peer's ``ready`` >= g and check its header against mine (else
   ``CollectiveMismatchError``, with both signatures);
4. reduce segment r of the piece (``even_bounds``: rank r owns the r-th of ``size`` near-equal
   segments): my values combined with each peer's, in place in my data area (peers read only
   their own segments of it); publish ``reduced`` = g;
5. copy each segment q of the result from rank q's data area into my output (one array or
   several), waiting for q's ``reduced`` >= g; publish ``done`` = g.

The input is read once and the output written once: no frames, no staging copies, no ring steps.
Each segment is reduced by one rank, so every rank gets bitwise the same result.

Small all-reduces (at most ``small_bytes``, 64 KiB by default) take one round instead of two: each
rank writes its input into one of two *slots* at the start of its data area (alternating by
generation), publishes ``ready``, waits for every peer's ``ready`` and then reduces the whole array
itself, reading every rank's slot in rank order (so again every rank computes bitwise the same
result), and publishes ``done``. A rank reuses a slot two generations later; by then every peer has
published the ``ready`` of the generation in between, which it does only after finishing its reads
of the slot, so the wait for ``done`` before a write costs nothing while small calls follow each other:
one wake-up per rank instead of two rounds of them.

float16 / bfloat16 sums, means and products are accumulated in float32 and rounded once, as in the ring.

Waits spin briefly when the host has a core per rank, then sleep on this rank's bell (a futex word
in its segment that the peers bump and wake), in slices that check the abort state reported over
gRPC, the processes of the ranks waited for and the deadline: a peer killed mid-collective gives
``PeerLostError``, a missing one ``CollectiveTimeoutError``, never a hang.

Header of a segment (byte offsets; the flags each on their own cache line)::

    [0, 4)      bell: futex word the peers wake; [4, 8) how many threads sleep on it (``Bell``)
    [64, 72)    ready    [128, 136) reduced    [192, 200) done      (generations, uint64)
    [256, 288)  piece header: collective seq, piece index, elements, signature length
    [320, ...)  signature text (at most SIG_MAX bytes)
    [1536, ...) the collective this rank has entered (any kind: sequence number + 1, signature), so a
                rank waiting here and a rank waiting on the ring in another collective see the mismatch
    [4096, ...) data area

Security and lifecycle are the ring segments' (``core.shared_memory``): created with ``O_EXCL`` and mode
0600 under an unguessable name exchanged over the authenticated store, unlinked as soon as every
rank has mapped it, stale ones of killed jobs removed at the next start.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from ...core.reduce_ops import (ReduceOp, combine_into, combine_to, finish_mean, needs_wide_accumulator,
                                reduce_in_rank_order)
from ...core.ring import even_bounds
from ...core.spans import Spans
from ...errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, PeerLostError
from ...core import shared_memory
from . import shm_cma
from ...core.shared_memory import HEADER_BYTES, SLICE_S, YIELD_S, Bell, Segment, fence, pid_alive, reported_cause

log = logging.getLogger("tf_commstrategy")

READY, REDUCED, DONE = 8, 16, 24      # uint64 indices of the flags (byte offsets 64, 128, 192)
INFO = 32                             # uint64 index of the piece header (byte offset 256)
DIRECT = 36                           # uint64 index (byte offset 288): a direct all-reduce's shared array:
                                      # allocation + 1 (0: none), byte offset, collective seq + 1
DIRECT_PIECE = (1 << 32) - 1          # the piece number in the header of a direct all-reduce's handshake
SIG_AT, SIG_MAX = 320, 1024           # signature text: byte offset, most bytes kept
CMA_AT = 168                          # uint64 index (byte offset 1344): a direct all-reduce's arrays for
                                      # cross-memory reads: input address, output address
LOST_GRACE_S = 1.0                    # a failed cross-memory read: how long the peer may take to disappear
CMA_CHUNK_BYTES = 256 << 10           # a peer's segment is read into a buffer of this size and reduced from
                                      # there: small enough to stay in the CPU's cache between the two
ENTERED = 192                         # uint64 index (byte offset 1536): the collective this rank is in, + 1
ENTERED_SIG = 200                     # uint64 index (byte offset 1600): its signature's length; text at 1664
ENTERED_SIG_AT = 1664
SMALL_BYTES = 64 << 10                # largest all-reduce (input bytes) that takes the one-round path
SLOT_HEAD = struct.Struct("<QQQ")    # a slot's header: collective seq, elements, signature length
SLOT_DATA_AT = 64 + SIG_MAX           # a slot: [0, 64) header (seq, elements, signature length), signature,
                                      # then the data
SMALL_PATH_CAPACITY = 2 * (SLOT_DATA_AT + SMALL_BYTES)  # a data area that holds exactly the two slots


class SharedBuffers:
    """This rank's fusion segment and its mappings of every peer's; runs the all-reduce pieces.

    Built by ``create`` (a collective step of the backend's setup); ``None`` there means the ring is
    used instead.
    """

    def __init__(self, rank: int, size: int, mine: Segment, peers: dict, capacity: int, pids: Sequence[int],
                 describe: Callable[[int], str], spin_s: float):
        self.rank, self.size, self.capacity = rank, size, capacity
        self._segs = dict(peers)
        self._segs[rank] = mine
        self._ctl = {q: np.frombuffer(s.mm, dtype=np.uint64, count=HEADER_BYTES // 8) for q, s in self._segs.items()}
        self._data = {q: s.u8[HEADER_BYTES:HEADER_BYTES + capacity] for q, s in self._segs.items()}
        self._bells = {q: Bell(s) for q, s in self._segs.items()}
        self._bell = self._bells[rank]
        self._peers = [q for q in range(size) if q != rank]
        self._pids = list(pids)
        self._describe = describe
        self.spin_s = spin_s
        self.yield_s = YIELD_S if spin_s == 0 else 0.0
        self.gen = 0
        self.direct_calls = 0  # all-reduces that went straight through the shared arrays
        self.cma_calls = 0  # ... that read the peers' private arrays by cross-memory attach
        self._cma_tmp: Optional[np.ndarray] = None
        # the one-round path: two slots at the start of the data area (none if the capacity is too small)
        self.small_bytes = max(0, min(SMALL_BYTES, capacity // 2 - SLOT_DATA_AT) // 64 * 64)
        self._slot_bytes = SLOT_DATA_AT + self.small_bytes
        self._last_small = False
        self._slot_views: dict = {}
        self._entered_sig: Optional[str] = None  # the signature text in my header now

    # -- setup -----------------------------------------------------------------------------------
    @classmethod
    def create(cls, store, rank: int, size: int, pids: Sequence[int], describe, capacity: int, timeout: float,
               spin_s: float, prefix: str = "shmfuse",
               known_problem: Optional[str] = None) -> Tuple[Optional["SharedBuffers"], Optional[str]]:
        """Every rank of the job calls this at the same point of its setup.

        Returns:
          (the buffers, or None (every rank alike) when any rank cannot create or map them; the
          problem found on this rank itself, for the job's one warning (``setup_report``), or None when
          there is none, the cause is a peer's, or it is ``known_problem``: this rank's shared-memory
          links fell back for it and are reported already).
        """
        reason = "turned off (TFCS_SHM_FUSION_BYTES=0)" if capacity <= 0 else (known_problem or
                                                                               shared_memory.available())
        warned = known_problem is not None or capacity <= 0  # reported already, or not a problem
        seg = None
        capacity = (max(capacity, 0) + 63) // 64 * 64
        if reason is None:
            try:
                seg = Segment.create(HEADER_BYTES + capacity, "fuse")
            except OSError as e:
                reason = (f"cannot reserve {(HEADER_BYTES + capacity) >> 20} MiB in {shared_memory.SHM_DIR} "
                          f"({e}; {shared_memory.free_mib()} MiB free)")
        peers, reason, own, theirs = shared_memory.map_all_ranks(store, prefix, rank, size, seg, reason,
                                                              {"capacity": capacity}, timeout)
        if reason is not None:
            log.debug("tf_commstrategy rank %d: shared all-reduce buffers unavailable (%s); all-reduce uses the "
                      "ring instead", rank, reason)
            return None, (reason if own and not warned else None)  # a peer's cause: that rank warns
        caps = [capacity] + [int(t.get("capacity") or 0) for t in theirs.values()]
        return cls(rank, size, seg, peers, min(caps), pids, describe, spin_s), None

    def close(self) -> None:
        self._ctl, self._data, self._bells, self._bell = {}, {}, {}, None  # no view may outlive the mappings
        self._slot_views = {}
        for s in self._segs.values():
            s.close()
        self._segs = {}

    # -- which collective each rank is in --------------------------------------------------------
    def enter(self, seq: int, sig: str) -> None:
        """Publish the collective this rank has just entered (every kind, ring ones too)."""
        ctl = self._ctl[self.rank]
        if sig is not self._entered_sig:  # the text already there stays right for the old and the new seq
            sig_b = sig.encode()[:SIG_MAX]
            ctl[ENTERED] = 0  # readers that catch the text half-written see 0 (or the new seq) and skip it
            fence()
            self._segs[self.rank].mm[ENTERED_SIG_AT:ENTERED_SIG_AT + len(sig_b)] = sig_b
            ctl[ENTERED_SIG] = len(sig_b)
            fence()
            self._entered_sig = sig
        ctl[ENTERED] = seq + 1

    def conflict(self, seq: int, sig: str) -> Optional[CollectiveMismatchError]:
        """A peer in collective ``seq`` under another signature: the mismatch error, else None."""
        sig_b = sig.encode()[:SIG_MAX]
        for q in self._peers:
            ctl = self._ctl.get(q)
            if ctl is None or int(ctl[ENTERED]) != seq + 1:
                continue
            fence()
            n = int(ctl[ENTERED_SIG])
            theirs = bytes(self._segs[q].mm[ENTERED_SIG_AT:ENTERED_SIG_AT + min(n, SIG_MAX)])
            fence()
            if int(ctl[ENTERED]) == seq + 1 and theirs != sig_b:  # still that collective: the text is its
                text = theirs.decode(errors="replace")
                return CollectiveMismatchError(
                    f"collective #{seq} mismatch: this rank called [{sig}] but rank {q} called [{text}]",
                    rank=self.rank, seq=seq, local_signature=sig, remote_signature=text, remote_rank=q,
                    fix="every rank must issue the same collectives in the same order with the same op, dtype, "
                        "shape and root")
        return None

    # -- waiting ---------------------------------------------------------------------------------
    def _ring_peers(self) -> None:
        for q in self._peers:
            self._bells[q].ring()

    def _lost(self, q: int) -> PeerLostError:
        return PeerLostError(f"rank {q} ({self._describe(q)}) is gone: its process exited or was killed while "
                             f"rank {self.rank} shared an all-reduce buffer with it", rank=self.rank, peer_rank=q,
                             fix=f"look at rank {q}'s log; restart the job (tfcs-run --max-restarts)")

    def _wait(self, flag: int, at_least: int, ranks: Sequence[int], deadline: float, abort, on_timeout) -> None:
        """Until ``ctl[q][flag] >= at_least`` for every q in ``ranks``."""
        ctl = self._ctl
        pending = [q for q in ranks if int(ctl[q][flag]) < at_least]
        if not pending:
            fence()  # off x86: the flags before the data they publish (as on the slow path)
            return
        spin_end = time.monotonic() + self.spin_s
        while True:
            seen = self._bell.value()
            fence()  # read the bell before the flags (x86 keeps loads in order; elsewhere this orders them)
            pending = [q for q in pending if int(ctl[q][flag]) < at_least]
            if not pending:
                fence()
                return
            now = time.monotonic()
            if now < spin_end:
                continue
            if now < spin_end + self.yield_s:
                os.sched_yield()
                continue
            problem = (abort() if abort is not None else None) or self._conflict_now()
            if problem is not None:
                raise problem
            for q in pending:
                if not pid_alive(self._pids[q]) and int(ctl[q][flag]) < at_least:
                    raise reported_cause(self._lost(q), abort)
            if now >= deadline:
                raise on_timeout(pending)
            self._bell.wait(seen, min(SLICE_S, deadline - now))

    # -- the all-reduce --------------------------------------------------------------------------
    def allreduce(self, srcs: Sequence[np.ndarray], outs: Sequence[np.ndarray], op: ReduceOp, seq: int, sig: str,
                  deadline: float, abort=None, on_timeout=None) -> None:
        """Reduce the concatenation of ``srcs`` over every rank into the concatenation of ``outs``.

        Args:
          srcs: this rank's input arrays, one dtype, read only (``outs`` may be the same arrays).
          outs: where the result goes, same dtype and total size.
          op: the reduction.
          seq: the collective's sequence number (checked against every peer's).
          sig: the collective's signature (checked likewise).
          deadline: ``time.monotonic()`` value after which a wait raises ``on_timeout(missing ranks)``.
          abort: returns the error another rank reported, or None.
          on_timeout: builds the timeout error from the ranks that did not arrive.

        Raises:
          CollectiveMismatchError: a peer runs another collective or shape.
          PeerLostError: a peer's process is gone.
          CollectiveTimeoutError: from ``on_timeout``, at the deadline.
        """
        self._current = (seq, sig)
        src, dst = Spans(srcs), Spans(outs)
        dtype = np.dtype(srcs[0].dtype) if srcs else np.dtype(np.uint8)
        total = src.size
        if on_timeout is None:
            on_timeout = self._default_timeout(seq, sig)
        if 0 < total * dtype.itemsize <= self.small_bytes:
            self._allreduce_small(src, dst, dtype, total, op, seq, sig, deadline, abort, on_timeout)
            return
        per_piece = max(1, self.capacity // max(dtype.itemsize, 1))
        wide = needs_wide_accumulator(dtype, op)
        sig_b = sig.encode()[:SIG_MAX]
        mine_ctl = self._ctl[self.rank]
        W, r = self.size, self.rank
        views = {q: d[:per_piece * dtype.itemsize].view(dtype) for q, d in self._data.items()}
        piece = 0
        lo = 0
        self._last_small = False
        while True:
            hi = min(total, lo + per_piece)
            n = hi - lo
            g = self.gen + 1
            # 1. the peers have read my previous piece
            self._wait(DONE, g - 1, self._peers, deadline, abort, on_timeout)
            mine = views[r][:n]
            src.read_into(mine, lo, hi)
            mine_ctl[INFO:INFO + 4] = (seq, piece, n, len(sig_b))
            self._segs[r].mm[SIG_AT:SIG_AT + len(sig_b)] = sig_b
            fence()
            mine_ctl[READY] = g
            self._ring_peers()
            # 2. everyone's piece is in place and is the same collective
            self._wait(READY, g, self._peers, deadline, abort, on_timeout)
            for q in self._peers:
                self._check(q, seq, piece, n, sig_b, sig)
            # 3. reduce my segment of the piece
            b = even_bounds(n, W)
            s0, s1 = b[r], b[r + 1]
            self._reduce_segment(views[r][s0:s1], [views[q][s0:s1] for q in self._peers], op, wide)
            fence()
            mine_ctl[REDUCED] = g
            self._ring_peers()
            # 4. gather every segment of the result, my own first
            dst.write_from(views[r][s0:s1], lo + s0, lo + s1)
            for k in range(1, W):
                q = (r + k) % W
                self._wait(REDUCED, g, (q,), deadline, abort, on_timeout)
                dst.write_from(views[q][b[q]:b[q + 1]], lo + b[q], lo + b[q + 1])
            fence()  # off x86: my reads of the peers' slots come before the word that lets them reuse them
            mine_ctl[DONE] = g
            self._ring_peers()
            self.gen = g
            piece += 1
            lo = hi
            if lo >= total:
                return

    def _reduce_segment(self, mine: np.ndarray, others: Sequence[np.ndarray], op: ReduceOp, wide: bool) -> None:
        """``mine`` (in place) combined with each of ``others`` (the peers' same segment), in that order;
        float16 / bfloat16 accumulated in float32 when ``wide``."""
        if mine.size == 0:
            return
        acc = mine.astype(np.float32) if wide else mine
        for other in others:
            combine_into(acc, other.astype(np.float32) if wide else other, op)
        if op is ReduceOp.MEAN:
            finish_mean(acc, self.size)
        if wide:
            mine[...] = acc

    def direct(self, arr: np.ndarray, found, op: ReduceOp, seq: int, sig: str, deadline: float, abort=None,
               on_timeout=None, src: Optional[np.ndarray] = None, cma: bool = False) -> bool:
        """An all-reduce into ``arr`` that reads the peers' arrays where they are: through the ranks' shared
        arrays (``shm_shared``) when every rank passes the same part of the same allocation in place, else
        by cross-memory attach (``shm_cma``) when ``cma``; otherwise only the handshake.

        Every rank calls this for the same collective, with the same ``cma`` (the backend decides both
        from job-wide facts). One generation: each rank publishes its header (seq, elements, signature,
        which allocation and offset its array is, ``found``, or none, and its arrays' addresses) and
        ``ready``. Then rank r reduces the r-th segment (``even_bounds``) of its array with the peers'
        r-th segments (read where they are, or copied out of the peers' address spaces a buffer at a
        time), publishes ``reduced``, copies every other segment q from rank q's array once q has
        published ``reduced``, publishes ``done`` and waits for every peer's ``done`` (they have stopped
        reading its arrays: they are the caller's again). When neither way applies each rank publishes
        ``done`` after reading the headers and the caller runs its usual path.

        Args:
          arr: this rank's 1-D C-contiguous output array (the input too when ``src`` is None).
          found: ``(SharedAllocation, byte offset)`` of ``arr`` when in place, or None (a private array).
          op, seq, sig, deadline, abort, on_timeout: as in ``allreduce``.
          src: the input when out of place (same size and dtype as ``arr``; only read).
          cma: whether the job reads private arrays by cross-memory attach for this call (every rank
            could read every peer at setup, the size is above the threshold, no float32 accumulator).

        Returns:
          True when ``arr`` holds the result; False when neither way applies (``arr`` untouched).

        Raises:
          CollectiveMismatchError, PeerLostError, CollectiveTimeoutError: as in ``allreduce``.
          CollectiveError: a peer's memory could not be read (it was readable at setup).
        """
        self._current = (seq, sig)
        if on_timeout is None:
            on_timeout = self._default_timeout(seq, sig)
        g = self.gen + 1
        r, W = self.rank, self.size
        n = arr.size
        sig_b = sig.encode()[:SIG_MAX]
        mine = self._ctl[r]
        # the peers have read my last header (a large piece's is read after its ready)
        self._wait(DONE, g - 1, self._peers, deadline, abort, on_timeout)
        alloc, off = found if found is not None and src is None else (None, 0)
        ident = alloc.ident + 1 if alloc is not None else 0
        mine[INFO:INFO + 4] = (seq, DIRECT_PIECE, n, len(sig_b))
        mine[DIRECT:DIRECT + 3] = (ident, off, seq + 1)
        mine[CMA_AT:CMA_AT + 2] = ((arr if src is None else src).ctypes.data, arr.ctypes.data)
        self._segs[r].mm[SIG_AT:SIG_AT + len(sig_b)] = sig_b
        fence()
        mine[READY] = g
        self._ring_peers()
        self._wait(READY, g, self._peers, deadline, abort, on_timeout)
        shared = alloc is not None
        for q in self._peers:
            self._check(q, seq, DIRECT_PIECE, n, sig_b, sig)
            if tuple(int(x) for x in self._ctl[q][DIRECT:DIRECT + 3]) != (ident, off, seq + 1):
                shared = False
        self.gen = g
        self._last_small = False
        if not shared and not cma:
            fence()
            mine[DONE] = g  # my reads of the headers are over
            self._ring_peers()
            return False
        dtype = arr.dtype
        b = even_bounds(n, W)
        s0, s1 = b[r], b[r + 1]
        if shared:
            theirs = {q: alloc.views[q][off:off + arr.nbytes].view(dtype) for q in self._peers}
            self._reduce_segment(arr[s0:s1], [theirs[q][s0:s1] for q in self._peers], op,
                                 needs_wide_accumulator(dtype, op))
        else:
            addrs = {q: (int(self._ctl[q][CMA_AT]), int(self._ctl[q][CMA_AT + 1])) for q in self._peers}
            self._reduce_segment_cma(arr, src, s0, s1, addrs, op, abort)
        fence()
        mine[REDUCED] = g
        self._ring_peers()
        for k in range(1, W):
            q = (r + k) % W
            self._wait(REDUCED, g, (q,), deadline, abort, on_timeout)
            if shared:
                arr[b[q]:b[q + 1]] = theirs[q][b[q]:b[q + 1]]
            else:
                self._read_peer(q, addrs[q][1] + b[q] * dtype.itemsize, arr[b[q]:b[q + 1]], abort)
        fence()  # off x86: my reads of the peers' arrays come before the word that lets them write again
        mine[DONE] = g
        self._ring_peers()
        self._wait(DONE, g, self._peers, deadline, abort, on_timeout)
        if shared:
            self.direct_calls += 1
        else:
            self.cma_calls += 1
        return True

    def _reduce_segment_cma(self, arr: np.ndarray, src: Optional[np.ndarray], s0: int, s1: int, addrs: dict,
                            op: ReduceOp, abort) -> None:
        """``arr[s0:s1]`` = the reduction of every rank's input there: mine (``src``, or ``arr`` in place)
        combined with the peers' in rank order, read out of their address spaces a buffer at a time."""
        isz = arr.dtype.itemsize
        if self._cma_tmp is None:
            self._cma_tmp = np.empty(CMA_CHUNK_BYTES, np.uint8)
        step = CMA_CHUNK_BYTES // isz
        tmp = self._cma_tmp[:step * isz].view(arr.dtype)
        for a in range(s0, s1, step):
            e = min(a + step, s1)
            out, part = arr[a:e], tmp[:e - a]
            for i, q in enumerate(self._peers):
                self._read_peer(q, addrs[q][0] + a * isz, part, abort)
                if i == 0 and src is not None:
                    combine_to(out, src[a:e], part, op)
                else:
                    combine_into(out, part, op)
            if op is ReduceOp.MEAN:
                finish_mean(out, self.size)

    def _read_peer(self, q: int, addr: int, into: np.ndarray, abort) -> None:
        try:
            shm_cma.read_array(self._pids[q], addr, into)
        except OSError as e:
            # A killed process loses its memory before it turns into a zombie: reads fail with ESRCH
            # while its pid still looks alive, so ESRCH means lost too, and any other failure gets a
            # moment for the process to disappear before it is blamed on the read
            end = time.monotonic() + LOST_GRACE_S
            while e.errno != errno.ESRCH and pid_alive(self._pids[q]) and time.monotonic() < end:
                time.sleep(0.01)
            if e.errno == errno.ESRCH or not pid_alive(self._pids[q]):
                raise reported_cause(self._lost(q), abort) from e
            raise reported_cause(CollectiveError(
                f"rank {self.rank} could not read rank {q}'s array ({into.nbytes} bytes at {addr:#x} in pid "
                f"{self._pids[q]}) during an all-reduce: {e}; it could at setup", rank=self.rank,
                fix="set TFCS_SHM_CMA=0 to take the ring instead, and report this"), abort) from e

    def _allreduce_small(self, src: Spans, dst: Spans, dtype: np.dtype, n: int, op: ReduceOp, seq: int, sig: str,
                         deadline: float, abort, on_timeout) -> None:
        """The one-round path (module docstring): every rank reduces the whole array from the slots."""
        g = self.gen + 1
        # the slot I am about to write was last read two generations ago, unless a piece of a large
        # all-reduce used the whole data area after it (then the peers must have finished that piece)
        self._wait(DONE, g - 2 if self._last_small else g - 1, self._peers, deadline, abort, on_timeout)
        slot = g % 2
        at = HEADER_BYTES + slot * self._slot_bytes  # offset in the segments
        sig_b = sig.encode()[:SIG_MAX]
        r = self.rank
        key = (slot, dtype, n)
        slots = self._slot_views.get(key)
        if slots is None:
            if len(self._slot_views) > 64:
                self._slot_views.clear()
            nbytes = n * dtype.itemsize
            slots = [self._segs[q].u8[at + SLOT_DATA_AT:at + SLOT_DATA_AT + nbytes].view(dtype)
                     for q in range(self.size)]
            self._slot_views[key] = slots
        src.read_into(slots[r], 0, n)
        mm = self._segs[r].mm
        SLOT_HEAD.pack_into(mm, at, seq, n, len(sig_b))
        mm[at + 64:at + 64 + len(sig_b)] = sig_b
        fence()
        self._ctl[r][READY] = g
        self._ring_peers()
        self._wait(READY, g, self._peers, deadline, abort, on_timeout)
        for q in self._peers:
            their = self._segs[q].mm
            t_seq, t_n, t_len = SLOT_HEAD.unpack_from(their, at)
            if t_seq != seq or t_n != n or their[at + 64:at + 64 + min(t_len, SIG_MAX)] != sig_b:
                # a peer in a large all-reduce wrote data over its slots: what it entered tells more
                problem = self.conflict(seq, sig)
                if problem is not None:
                    raise problem
                self._mismatch(q, seq, sig, 0, n, t_seq, bytes(their[at + 64:at + 64 + min(t_len, SIG_MAX)]), 0,
                               t_n)
        acc = reduce_in_rank_order(slots, op)
        fence()
        self._ctl[r][DONE] = g  # my reads of the peers' slots are over
        self._ring_peers()
        dst.write_from(acc if acc.dtype == dtype else acc.astype(dtype), 0, n)
        self.gen = g
        self._last_small = True

    def _conflict_now(self):
        cur = getattr(self, "_current", None)
        return self.conflict(*cur) if cur is not None else None

    def _check(self, q: int, seq: int, piece: int, n: int, sig_b: bytes, sig: str) -> None:
        theirs = tuple(int(x) for x in self._ctl[q][INFO:INFO + 4])
        their_sig = bytes(self._segs[q].mm[SIG_AT:SIG_AT + theirs[3]])
        if theirs[:3] == (seq, piece, n) and their_sig == sig_b:
            return
        # the piece header may still describe the peer's last large piece (it took the one-round small
        # path this time): the signature it entered this collective with names its call
        entered = self.conflict(seq, sig)
        if entered is not None:
            raise entered
        self._mismatch(q, seq, sig, piece, n, theirs[0], their_sig, theirs[1], theirs[2])

    def _mismatch(self, q: int, seq: int, sig: str, piece: int, n: int, their_seq: int, their_sig: bytes,
                  their_piece: int, their_n: int):
        text = their_sig.decode(errors="replace")

        def what(p):
            return "shared-array handshake" if p == DIRECT_PIECE else f"piece {p}"
        raise CollectiveMismatchError(
            f"collective #{seq} mismatch in the shared-memory all-reduce: this rank called [{sig}] ({what(piece)}, "
            f"{n} elements) but rank {q} called #{their_seq} [{text}] ({what(their_piece)}, {their_n} elements)",
            rank=self.rank, seq=seq, local_signature=sig, remote_signature=text, remote_rank=q,
            fix="every rank must issue the same collectives in the same order with the same op, dtype and shape")

    def _default_timeout(self, seq: int, sig: str):
        def build(missing):
            return CollectiveTimeoutError(
                f"collective #{seq} [{sig}] timed out in the shared-memory all-reduce waiting for ranks {missing}",
                rank=self.rank, seq=seq, waiting_for=list(missing),
                fix="a rank is missing, stuck, or calling a different sequence of collectives; or raise the "
                    "deadline (TFCS_TIMEOUT)")
        return build
