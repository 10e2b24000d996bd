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
    [1408, 1416) whether this rank's last generation used the whole data area
    [1536, ...) the collective this rank has entered (any kind: sequence number + 1, signature), so a
                rank waiting here and a rank waiting on the ring in another collective see the mismatch
    [4096, ...) data area: the two-round pieces use all of it; the one-round slots g % 2 each half of it
                (a slot: [0, 64) collective number, elements, signature length; the signature; the data)

Security and lifecycle are the ring segments' (``core.shared_memory``): created with ``O_EXCL`` and mode
0600 under an unguessable name exchanged over the authenticated store, unlinked as soon as every
rank has mapped it, stale ones of killed jobs removed at the next start.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from ...core.reduce_ops import (ReduceOp, combine_into, finish_mean, needs_wide_accumulator,
                                reduce_in_rank_order)
from ...core.ring import even_bounds
from ...core.spans import Spans
from ...errors import CollectiveTimeoutError, PeerLostError
from ...core import shared_memory
from ...core.shared_memory import HEADER_BYTES, SLICE_S, YIELD_S, Bell, Segment, fence, pid_alive, reported_cause

log = logging.getLogger("tf_commstrategy")

from .shm_entries import Entries
from .shm_layout import (DONE, INFO, LAST_WHOLE, READY, REDUCED, SIG_AT, SIG_MAX, SLOT_DATA_AT, SLOT_HEAD,
                         SLOT_TEXT_AT, SMALL_BYTES)


class SharedBuffers:
    """This rank's fusion segment and its mappings of every peer's; runs the all-reduce pieces.

    Built by ``create`` (a collective step of the backend's setup); ``None`` there means the ring is
    used instead.
    """

    def __init__(self, rank: int, size: int, mine: Segment, peers: dict, capacity: int, pids: Sequence[int],
                 describe: Callable[[int], str], spin_s: float):
        self.rank, self.size, self.capacity = rank, size, capacity
        self.segs = dict(peers)
        self.segs[rank] = mine
        self.ctl = {q: np.frombuffer(s.mm, dtype=np.uint64, count=HEADER_BYTES // 8) for q, s in self.segs.items()}
        self._data = {q: s.u8[HEADER_BYTES:HEADER_BYTES + capacity] for q, s in self.segs.items()}
        self._bells = {q: Bell(s) for q, s in self.segs.items()}
        self._bell = self._bells[rank]
        self.peers = [q for q in range(size) if q != rank]
        self.pids = list(pids)
        self._describe = describe
        self.spin_s = spin_s
        self.yield_s = YIELD_S if spin_s == 0 else 0.0
        self._mine = self.ctl[rank]
        self.direct_calls = 0  # all-reduces that went straight through the shared arrays
        self.cma_calls = 0  # ... that read the peers' private arrays by cross-memory attach
        self.cma_tmp: Optional[np.ndarray] = None  # shm_direct's staging buffer, made on first use
        # the one-round path: a slot in each half of the data area (none if the capacity is too small)
        self.slot_stride = capacity // 2 // 64 * 64
        self.small_bytes = max(0, min(SMALL_BYTES, self.slot_stride - SLOT_DATA_AT) // 64 * 64)
        self._slot_views: dict = {}
        self.entries = Entries(rank, self.segs, self.ctl, self.peers, describe)
        self.current: Optional[Tuple[int, str]] = None  # the collective whose waits run now

    @property
    def gen(self) -> int:
        """Generations this rank has started (its ``ready`` word counts them)."""
        return int(self._mine[READY])

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
        self.ctl, self._data, self._bells, self._bell = {}, {}, {}, None  # no view may outlive the mappings
        self._slot_views = {}
        for s in self.segs.values():
            s.close()
        self.segs = {}

    # -- waiting ---------------------------------------------------------------------------------
    def ring_peers(self) -> None:
        for q in self.peers:
            self._bells[q].ring()

    def lost(self, q: int) -> PeerLostError:
        return PeerLostError(f"rank {q} ({self._describe(q)}) is gone: its process exited or was killed while "
                             f"rank {self.rank} shared an all-reduce buffer with it", rank=self.rank, peer_rank=q,
                             fix=f"look at rank {q}'s log; restart the job (tfcs-run --max-restarts)")

    def wait(self, flag: int, at_least: int, ranks: Sequence[int], deadline: float, abort, on_timeout) -> None:
        """Until ``ctl[q][flag] >= at_least`` for every q in ``ranks``."""
        ctl = self.ctl
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
                if not pid_alive(self.pids[q]) and int(ctl[q][flag]) < at_least:
                    raise reported_cause(self.lost(q), abort)
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
        self.current = (seq, sig)
        src, dst = Spans(srcs), Spans(outs)
        dtype = np.dtype(srcs[0].dtype) if srcs else np.dtype(np.uint8)
        total = src.size
        if on_timeout is None:
            on_timeout = self.default_timeout(seq, sig)
        if 0 < total * dtype.itemsize <= self.small_bytes:
            self._allreduce_small(src, dst, dtype, total, op, seq, sig, deadline, abort, on_timeout)
            return
        per_piece = max(1, self.capacity // max(dtype.itemsize, 1))
        views = {q: d[:per_piece * dtype.itemsize].view(dtype) for q, d in self._data.items()}
        call = (seq, sig, sig.encode()[:SIG_MAX], op, needs_wide_accumulator(dtype, op), deadline, abort, on_timeout)
        piece, lo = 0, 0
        while True:
            hi = min(total, lo + per_piece)
            self._two_round_piece(views, src, dst, lo, hi, piece, call)
            piece += 1
            lo = hi
            if lo >= total:
                return

    def _two_round_piece(self, views: dict, src: Spans, dst: Spans, lo: int, hi: int, piece: int, call) -> None:
        """Elements [lo, hi) of the all-reduce as one generation: in, reduce my segment, gather the rest."""
        seq, sig, sig_b, op, wide, deadline, abort, on_timeout = call
        n = hi - lo
        W, r = self.size, self.rank
        mine_ctl = self._mine
        g = self.gen + 1
        # 1. the peers have read my previous piece
        self.wait(DONE, g - 1, self.peers, deadline, abort, on_timeout)
        src.read_into(views[r][:n], lo, hi)
        mine_ctl[INFO:INFO + 4] = (seq, piece, n, len(sig_b))
        self.segs[r].mm[SIG_AT:SIG_AT + len(sig_b)] = sig_b
        mine_ctl[LAST_WHOLE] = 1
        fence()
        mine_ctl[READY] = g
        self.ring_peers()
        # 2. everyone's piece is in place and is the same collective
        self.wait(READY, g, self.peers, deadline, abort, on_timeout)
        for q in self.peers:
            self.entries.check(q, seq, piece, n, sig_b, sig)
        # 3. reduce my segment of the piece
        b = even_bounds(n, W)
        s0, s1 = b[r], b[r + 1]
        self.reduce_segment(views[r][s0:s1], [views[q][s0:s1] for q in self.peers], op, wide)
        fence()
        mine_ctl[REDUCED] = g
        self.ring_peers()
        # 4. gather every segment of the result, my own first
        dst.write_from(views[r][s0:s1], lo + s0, lo + s1)
        for k in range(1, W):
            q = (r + k) % W
            self.wait(REDUCED, g, (q,), deadline, abort, on_timeout)
            dst.write_from(views[q][b[q]:b[q + 1]], lo + b[q], lo + b[q + 1])
        fence()  # off x86: my reads of the peers' slots come before the word that lets them reuse them
        mine_ctl[DONE] = g
        self.ring_peers()

    def reduce_segment(self, mine: np.ndarray, others: Sequence[np.ndarray], op: ReduceOp, wide: bool) -> None:
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

    def _allreduce_small(self, src: Spans, dst: Spans, dtype: np.dtype, n: int, op: ReduceOp, seq: int, sig: str,
                         deadline: float, abort, on_timeout) -> None:
        """The one-round path (module docstring): every rank reduces the whole array from the slots."""
        g = self.gen + 1
        # the slot I am about to write was last read two generations ago, unless a piece of a large
        # all-reduce used the whole data area after it (then the peers must have finished that piece)
        mine = self._mine
        self.wait(DONE, g - 1 if mine[LAST_WHOLE] else g - 2, self.peers, deadline, abort, on_timeout)
        slot = g % 2
        at = HEADER_BYTES + slot * self.slot_stride  # offset in the segments
        sig_b = sig.encode()[:SIG_MAX]
        r = self.rank
        key = (slot, dtype, n)
        slots = self._slot_views.get(key)
        if slots is None:
            if len(self._slot_views) > 64:
                self._slot_views.clear()
            nbytes = n * dtype.itemsize
            slots = [self.segs[q].u8[at + SLOT_DATA_AT:at + SLOT_DATA_AT + nbytes].view(dtype)
                     for q in range(self.size)]
            self._slot_views[key] = slots
        src.read_into(slots[r], 0, n)
        mm = self.segs[r].mm
        SLOT_HEAD.pack_into(mm, at, seq, n, len(sig_b))
        mm[at + SLOT_TEXT_AT:at + SLOT_TEXT_AT + len(sig_b)] = sig_b
        mine[LAST_WHOLE] = 0
        fence()
        mine[READY] = g
        self.ring_peers()
        self.wait(READY, g, self.peers, deadline, abort, on_timeout)
        for q in self.peers:
            their = self.segs[q].mm
            t_seq, t_n, t_len = SLOT_HEAD.unpack_from(their, at)
            if t_seq != seq or t_n != n or their[at + 64:at + 64 + min(t_len, SIG_MAX)] != sig_b:
                # a peer in a large all-reduce wrote data over its slots: what it entered tells more
                problem = self.entries.conflict(seq, sig)
                if problem is not None:
                    raise problem
                self.entries.mismatch(q, seq, sig, 0, n, t_seq, bytes(their[at + 64:at + 64 + min(t_len, SIG_MAX)]), 0,
                               t_n)
        acc = reduce_in_rank_order(slots, op)
        fence()
        mine[DONE] = g  # my reads of the peers' slots are over
        self.ring_peers()
        dst.write_from(acc if acc.dtype == dtype else acc.astype(dtype), 0, n)

    def _conflict_now(self):
        cur = self.current
        return self.entries.conflict(*cur) if cur is not None else None

    def default_timeout(self, seq: int, sig: str):
        def build(missing):
            return CollectiveTimeoutError(
                f"collective #{seq} [{sig}] timed out in the shared-memory all-reduce waiting for ranks {missing}",
                rank=self.rank, seq=seq, waiting_for=list(missing),
                fix="a rank is missing, stuck, or calling a different sequence of collectives; or raise the "
                    "deadline (TFCS_TIMEOUT)")
        return build
