"""Shared-memory data path between ring neighbours on one host.

Each rank ``c`` whose left neighbour ``p`` is on the same host (same hostname, boot id, network, mount
and pid namespace) owns a *ring segment*: a single-producer / single-consumer byte ring in ``/dev/shm``
that ``p`` writes frames into and ``c`` reads them from, in the calling threads, without a copy on
the receiving side (the ring reduces straight out of shared memory). Every rank with a shared-memory
link also owns a *bell*: one 32-bit futex word that its neighbours bump and wake when they wrote
data for it or freed space it waits for. Waits spin briefly when the host has a core per rank, then
sleep on the bell (``futex``) in short slices; each slice checks the abort state (peer lost, timeout,
mismatch reported over gRPC), the neighbour's process and the deadline, so no wait is unbounded.

Layout of a ring segment::

    [0, 8)      head: bytes written so far (producer)       own cache line
    [64, 72)    tail: bytes consumed so far (consumer)      own cache line
    [128, 132)  closed flag (producer shut down cleanly)
    [4096, ...) data area of ``capacity`` bytes: frames, each 64-byte aligned and contiguous
                (a WRAP frame sends the reader back to the start)

A frame is ``FRAME`` (magic, sig_len, seq, step, chunk, nbytes), the collective's signature, then
the payload at the next 64-byte boundary. The producer publishes ``head`` only after the frame's
bytes are in place; x86's ordering makes that sufficient, elsewhere a full fence (``shared_memory.fence``:
C11 ``atomic_thread_fence``) separates the two, and the consumer fences between reading ``head``
and reading the frame.

Lifecycle and security (the segments, bells and fences are ``core.shared_memory``'s): segments are created
by their owner with ``O_EXCL``, mode 0600, under an unguessable name (``tfcs-shm-<pid>-<random>``)
that travels only over the authenticated control plane (the coordinator). Once both neighbours have
mapped them, the owner unlinks them: nothing is left in ``/dev/shm`` after that, even if the job is
killed. A segment left by a job killed during that short
window is recognised by its dead owner pid and removed at the next start. A ``/dev/shm`` too small
for the segment (containers default to 64 MiB) is found when the space is reserved
(``posix_fallocate``), and the link falls back to Unix sockets with one warning.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from ...errors import CollectiveTimeoutError, PeerLostError
from ...core.shared_memory import (BELL_BYTES, HEADER_BYTES, SHM_DIR, SLICE_S, YIELD_S, Bell, Segment, align, available, fence,
                         free_mib, pid_alive, remove_stale_segments, reported_cause)
from .outbound import Outbound

log = logging.getLogger("tf_commstrategy")

FRAME = struct.Struct("<IIQIIQ")  # magic, sig_len, seq, step, chunk, nbytes (32 bytes)
MAGIC_FRAME = 0x54464653  # "SFFT"
MAGIC_WRAP = 0x57524150   # "PARW"
HEAD, TAIL, CLOSED = 0, 8, 16  # indices into the segment header viewed as uint64 (offsets 0, 64, 128)


class _Waiter:
    """The shared wait loop of both ends: spin, then sleep on my bell, checking aborts and the peer."""

    def __init__(self, my_bell: Bell, peer_rank: int, peer_pid: int, my_rank: int, describe, spin_s: float):
        self.bell, self.peer_rank, self.peer_pid, self.my_rank = my_bell, peer_rank, peer_pid, my_rank
        self._describe, self.spin_s = describe, spin_s
        # With more ranks than cores a busy spin only delays the rank we wait for, and a futex wake-up
        # costs a scheduler round trip per hop: yield the CPU for a while first (the peer, sharing the
        # core, runs at once), then sleep on the bell.
        self.yield_s = YIELD_S if spin_s == 0 else 0.0

    def lost(self) -> PeerLostError:
        return PeerLostError(f"rank {self.peer_rank} ({self._describe(self.peer_rank)}) is gone: its process "
                             f"exited or was killed while rank {self.my_rank} shared memory with it",
                             rank=self.my_rank, peer_rank=self.peer_rank,
                             fix=f"look at rank {self.peer_rank}'s log; restart the job (tfcs-run --max-restarts)")

    def explain(self, error: BaseException, abort) -> BaseException:
        return reported_cause(error, abort)

    def until(self, ready: Callable[[], bool], deadline: float, abort, pump=None) -> bool:
        """Wait until ``ready()``; False at the deadline. Raises what ``abort()`` returns, or PeerLostError."""
        if ready():
            return True
        spin_end = time.monotonic() + self.spin_s
        while True:
            seen = self.bell.value()
            fence()  # read the bell before the data's state (see shm_buffers)
            busy = pump() if pump is not None else False
            if ready():
                return True
            now = time.monotonic()
            if now < spin_end:
                continue
            if now < spin_end + self.yield_s:
                os.sched_yield()  # more ranks than cores: let the rank we wait for run, without a wake-up
                continue
            problem = abort() if abort is not None else None
            if problem is not None:
                raise problem
            if not pid_alive(self.peer_pid):
                if ready():
                    return True
                raise self.explain(self.lost(), abort)
            if now >= deadline:
                return ready()
            # frames still queued for a socket outbound: come back soon to write them
            self.bell.wait(seen, min(0.0005 if busy else SLICE_S, deadline - now))


class _RingEnd:
    """One end of a ring segment: its control words, its data area, the neighbour's bell."""

    def __init__(self, ring: Segment, peer_bell: Bell, waiter: _Waiter, my_rank: int, peer_rank: int):
        self.ring, self.peer_bell, self.waiter = ring, peer_bell, waiter
        self.my_rank, self.peer_rank = my_rank, peer_rank
        self.capacity = ring.size - HEADER_BYTES
        self._ctl = np.frombuffer(ring.mm, dtype=np.uint64, count=HEADER_BYTES // 8)
        self._data = ring.u8[HEADER_BYTES:]


class ShmSender(_RingEnd, Outbound):
    """Frames to the right neighbour through its ring segment (the ``send_frame`` / ``drain`` interface
    of the socket and gRPC streams). A frame that does not fit yet is queued and written when the
    neighbour frees space: by ``pump`` (called from every wait of this rank) or ``drain``."""

    wakes_on_space = True  # the neighbour rings this rank's bell as it frees space

    def __init__(self, ring: Segment, peer_bell: Bell, waiter: _Waiter, my_rank: int, peer_rank: int):
        super().__init__(ring, peer_bell, waiter, my_rank, peer_rank)
        self._head = int(self._ctl[HEAD])
        self._pending = deque()
        self.max_frame = self.capacity // 4

    def _write(self, item) -> bool:
        hdr_len, total, header, sig, payload = item
        pos = self._head % self.capacity
        wrap = self.capacity - pos if pos + total > self.capacity else 0
        tail = int(self._ctl[TAIL])
        if self.capacity - (self._head - tail) < wrap + total:
            return False
        if wrap:
            self._data[pos:pos + FRAME.size] = np.frombuffer(FRAME.pack(MAGIC_WRAP, 0, 0, 0, 0, 0), np.uint8)
            self._head += wrap
            pos = 0
        self._data[pos:pos + len(header)] = np.frombuffer(header, np.uint8)
        if sig:
            self._data[pos + FRAME.size:pos + FRAME.size + len(sig)] = np.frombuffer(sig, np.uint8)
        n = payload.nbytes
        if n:
            self._data[pos + hdr_len:pos + hdr_len + n] = payload
        fence()
        self._head += total
        self._ctl[HEAD] = self._head
        return True

    def send_frame(self, seq: int, step: int, chunk: int, sig: bytes, payload) -> None:
        view = np.frombuffer(payload, dtype=np.uint8) if len(payload) else np.empty(0, np.uint8)
        n = view.nbytes
        hdr_len = align(FRAME.size + len(sig))
        total = align(hdr_len + n)
        if total > self.max_frame:
            raise ValueError(f"a {n}-byte chunk does not fit the shared-memory ring of {self.capacity} bytes")
        item = (hdr_len, total, FRAME.pack(MAGIC_FRAME, len(sig), seq, step, chunk, n), sig, view)
        if not self._pending and self._write(item):
            self.peer_bell.ring()
            return
        self._pending.append(item)

    def pump(self) -> bool:
        """Write queued frames that fit now; True while some are still queued."""
        wrote = False
        while self._pending and self._write(self._pending[0]):
            self._pending.popleft()
            wrote = True
        if wrote:
            self.peer_bell.ring()
        return bool(self._pending)

    def drain(self, timeout: float, abort=None) -> None:
        """Wait until every queued frame is written (the caller may then reuse the buffers)."""
        if not self._pending:
            return
        deadline = time.monotonic() + timeout
        if not self.waiter.until(lambda: not self.pump(), deadline, abort):
            raise CollectiveTimeoutError(
                f"could not hand data to rank {self.peer_rank} through shared memory before the deadline: it "
                f"stopped reading (stalled or stuck)", rank=self.my_rank, waiting_for=[self.peer_rank],
                fix=f"rank {self.peer_rank} is stuck; see its log, or raise the deadline (TFCS_TIMEOUT)")

    def broken(self) -> Optional[PeerLostError]:
        return None if pid_alive(self.waiter.peer_pid) else self.waiter.lost()

    def close(self, timeout: float = 5.0) -> None:
        try:
            self.drain(timeout)
        except Exception:
            pass
        self._ctl[CLOSED] = 1
        self.peer_bell.ring()
        self._pending.clear()
        self._data = None
        self._ctl = None
        self.ring.close()


class ShmReceiver(_RingEnd):
    """Frames from the left neighbour, read in place from this rank's ring segment."""

    def __init__(self, ring: Segment, peer_bell: Bell, waiter: _Waiter, my_rank: int, peer_rank: int):
        super().__init__(ring, peer_bell, waiter, my_rank, peer_rank)
        self._tail = int(self._ctl[TAIL])
        self._held = 0  # bytes of the frame handed out by the last take, released at the next one

    def release(self) -> None:
        """The caller is done with the last payload: give its space back to the producer."""
        if self._held:
            self._tail += self._held
            self._held = 0
            fence()  # off x86: my reads of the payload come before the producer may overwrite it
            self._ctl[TAIL] = self._tail
            self.peer_bell.ring()

    def take(self, key, deadline: float, sig: bytes, abort=None, outbound=None):
        """The frame for ``key`` = (seq, step, chunk): (sig, payload uint8 view) or None at the deadline.
        ``outbound`` (this rank's stream to its right neighbour) is pumped while waiting.

        The view stays valid until the next ``take`` / ``release``. A frame of the same collective
        under another signature returns (its sig, None) like the mailbox; a frame of another collective
        or position means the ranks run different code and raises through the caller's mismatch check.
        """
        self.release()
        ctl = self._ctl

        def ready():
            return int(ctl[HEAD]) > self._tail or int(ctl[CLOSED]) != 0

        pump = outbound.pump if outbound is not None else None
        if outbound is not None and outbound.wakes_on_space:
            # a shared-memory outbound: the neighbour rings our bell when it frees space, so the wait
            # may sleep; only a socket outbound with queued frames needs the short polls
            shm_pump = pump

            def pump():
                shm_pump()
                return False
        if not self.waiter.until(ready, deadline, abort, pump):
            return None
        while True:
            if int(ctl[HEAD]) <= self._tail:  # closed, nothing left
                raise self.waiter.explain(PeerLostError(
                    f"rank {self.peer_rank} ({self.waiter._describe(self.peer_rank)}) shut down its process "
                    f"group while rank {self.my_rank} still expected data from it", rank=self.my_rank,
                    peer_rank=self.peer_rank, fix="every rank must make the same collective calls; a rank left early"),
                    abort)
            fence()
            pos = self._tail % self.capacity
            magic, sig_len, seq, step, chunk, n = FRAME.unpack_from(self.ring.mm, HEADER_BYTES + pos)
            if magic == MAGIC_WRAP:
                self._tail += self.capacity - pos
                continue
            if magic != MAGIC_FRAME:
                raise PeerLostError(f"the shared-memory ring from rank {self.peer_rank} is corrupt (magic "
                                    f"{magic:#x} at offset {pos})", rank=self.my_rank, peer_rank=self.peer_rank,
                                    fix="report this as a bug")
            hdr_len = align(FRAME.size + sig_len)
            got_sig = bytes(self.ring.mm[HEADER_BYTES + pos + FRAME.size:HEADER_BYTES + pos + FRAME.size + sig_len])
            self._held = align(hdr_len + n)
            if (seq, step, chunk) != tuple(key):
                if seq == key[0] and got_sig != sig:
                    return got_sig, None
                text = f"frame for collective #{seq} step {step} chunk {chunk} [{got_sig.decode(errors='replace')}]"
                return text.encode(), None
            return got_sig, self._data[pos + hdr_len:pos + hdr_len + n]

    def close(self) -> None:
        self._held = 0
        self._data = None
        self._ctl = None
        self.ring.close()


def ring_bytes(chunk_bytes: int) -> int:
    """Segment size for a ring whose chunks are at most ``chunk_bytes``: room for four frames."""
    return HEADER_BYTES + max(4 << 20, 4 * align(chunk_bytes + 4096))


def _discard(*segments: Optional[Segment]) -> None:
    """Unlink and close this rank's own segments (None entries are skipped)."""
    for seg in segments:
        if seg is not None:
            seg.unlink()
            seg.close()


def _create_own_segments(rank: int, want_in: bool, want_out: bool, chunk_bytes: int):
    """This rank's bell, and its ring when it has an inbound link: ``(bell, ring, reason)``.

    Both are None with ``reason`` saying why when shared memory cannot be used here (or no link wants
    it: then ``reason`` is None too). Stale segments of killed jobs are swept first; a ``/dev/shm`` too
    small for the ring shows when the space is reserved, and nothing is kept then.
    """
    reason = None
    bell = ring = None
    if want_in or want_out:
        reason = available()
        if reason is None:
            removed = remove_stale_segments()
            if removed:
                log.warning("tf_commstrategy rank %d: removed %d stale shared-memory segment(s) left by "
                            "killed jobs in %s", rank, removed, SHM_DIR)
            try:
                bell = Segment.create(BELL_BYTES, "bell")
                if want_in:
                    ring = Segment.create(ring_bytes(chunk_bytes), "ring")
            except OSError as e:
                free = free_mib()
                reason = (f"cannot reserve {ring_bytes(chunk_bytes) >> 20} MiB in {SHM_DIR} ({e}; "
                          f"{free} MiB free)")
                _discard(bell, ring)
                bell = ring = None
    return bell, ring, reason


class _PeerSegments:
    """The neighbours' segments this rank maps during ``ShmLinks``'s set-up.

    They live here rather than in locals so that a set-up failing half way closes whatever it mapped.
    """

    def __init__(self):
        self.left_bell: Optional[Bell] = None
        self.right_ring: Optional[Segment] = None
        self.right_bell: Optional[Bell] = None

    def close(self) -> None:
        """Close (never unlink: their owners do) every segment mapped so far."""
        for seg in (self.left_bell.seg if self.left_bell else None, self.right_ring,
                    self.right_bell.seg if self.right_bell else None):
            if seg is not None:
                seg.close()


class ShmLinks:
    """Sets up this rank's shared-memory links over the coordinator store (a collective step of init).

    For the link p -> c (p = c - 1): c creates its ring and bell and publishes their names; p maps
    them, c maps p's bell; p declares the link ("1") only if all of that worked, else "0" and both
    ends fall back to Unix sockets. Each owner unlinks its segments once its neighbours have mapped
    them (or given up), so nothing stays in /dev/shm.
    """

    def __init__(self, store, rank: int, left: int, right: int, want_in: bool, want_out: bool, pids, describe,
                 chunk_bytes: int, timeout: float, spin_s: float, prefix: str = "shm"):
        """``left`` / ``right``: the global ranks of this ring's neighbours; ``prefix`` names this ring's
        keys in the store (one set of links per ring: the job's ring, and the hierarchy's sub-rings)."""
        self.rank = rank
        self.sender: Optional[ShmSender] = None
        self.receiver: Optional[ShmReceiver] = None
        self.own_problem: Optional[str] = None
        bell, ring, reason = _create_own_segments(rank, want_in, want_out, chunk_bytes)
        peers = _PeerSegments()
        try:
            mine = {"bell": bell.path if bell else None, "ring": ring.path if ring else None, "why": reason}
            store.set(f"{prefix}/seg/{rank}", json.dumps(mine))
            self.fallback_reason = reason
            self.own_problem = reason  # a cause found on this rank (the job's report warns about it once)
            my_bell = Bell(bell) if bell else None

            def waiter(peer: int) -> _Waiter:
                return _Waiter(my_bell, peer, pids[peer], rank, describe, spin_s)
            # the left neighbour's bell: I ring it when I free space in my ring
            if want_in and my_bell is not None:
                theirs = json.loads(store.get(f"{prefix}/seg/{left}", timeout))
                try:
                    peers.left_bell = Bell(Segment.attach(theirs["bell"])) if theirs["bell"] else None
                except OSError as e:
                    self._found(f"cannot map rank {left}'s bell: {e}", own=True)
            if want_in:
                store.set(f"{prefix}/bellok/{rank}", "1" if peers.left_bell is not None else "0")
            if want_out:
                self._connect_out(store, prefix, right, timeout, my_bell, peers, waiter)
            if want_in:
                in_ok = store.get(f"{prefix}/link/{rank}", timeout) == "1"
                if in_ok:
                    self.receiver = ShmReceiver(ring, peers.left_bell, waiter(left), rank, left)
                elif ring is not None:
                    ring.unlink()
                    ring.close()
            # everyone who maps my segments has done so (or given up): unlink them
            if ring is not None:
                ring.unlink()
            if bell is not None:
                bell.unlink()
        except BaseException:  # the store failed us (a neighbour gone, a deadline): leave nothing in /dev/shm
            _discard(bell, ring)
            peers.close()
            remove_stale_segments()  # and a neighbour's, if it died before unlinking them (kill -9 mid-setup)
            raise
        self.bell = my_bell
        self.fell_back = (want_in and self.receiver is None) or (want_out and self.sender is None)
        if self.fell_back:  # rank 0 warns once for the job (setup_report)
            log.debug("tf_commstrategy rank %d: shared memory unavailable (%s); using Unix sockets instead",
                      rank, self.fallback_reason or "a neighbour could not use it")

    def _connect_out(self, store, prefix: str, right: int, timeout: float, my_bell: Optional[Bell],
                     peers: "_PeerSegments", waiter: Callable[[int], _Waiter]) -> None:
        """The outbound half of the set-up: map the right neighbour's ring and bell, declare the link.

        The link is declared ("1" under ``<prefix>/link/<right>``) only if both segments mapped and the
        right neighbour mapped this rank's bell; then ``self.sender`` writes into its ring, else what was
        mapped is closed again. ``peers`` holds the mapped segments, so a failing set-up closes them.
        """
        theirs = json.loads(store.get(f"{prefix}/seg/{right}", timeout))
        if my_bell is not None and theirs["ring"] and theirs["bell"]:
            try:
                peers.right_ring = Segment.attach(theirs["ring"])
                peers.right_bell = Bell(Segment.attach(theirs["bell"]))
            except OSError as e:
                self._found(f"cannot map rank {right}'s segments: {e}", own=True)
        elif theirs.get("why"):
            self._found(f"rank {right}: {theirs['why']}", own=False)
        bell_ok = store.get(f"{prefix}/bellok/{right}", timeout) == "1"
        out_ok = peers.right_ring is not None and peers.right_bell is not None and bell_ok
        store.set(f"{prefix}/link/{right}", "1" if out_ok else "0")
        if out_ok:
            self.sender = ShmSender(peers.right_ring, peers.right_bell, waiter(right), self.rank, right)
        else:
            for seg in (peers.right_ring, peers.right_bell.seg if peers.right_bell else None):
                if seg is not None:
                    seg.close()

    def _found(self, cause: str, own: bool) -> None:
        """Note why a link falls back. The first cause stays (a later failure usually follows from it);
        ``own``: found on this rank, not named by a neighbour (the job's report warns about own causes)."""
        if self.fallback_reason is None:
            self.fallback_reason = cause
        if own and self.own_problem is None:
            self.own_problem = cause

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
