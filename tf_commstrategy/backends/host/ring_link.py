"""What ``core.ring`` talks to for one collective of the grpc backend: frames keyed by the collective's
sequence number, ring step and chunk, signed with its signature, sent to the right neighbour and taken
from the left one over the pair's data path (shared memory, a raw socket or gRPC), every wait
bounded by the collective's deadline.
"""

from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from ...core.ring import RingLink
from ...errors import CollectiveMismatchError, CollectiveTimeoutError
from . import links, socket_transport


class CollectiveLink(RingLink):
    """core.ring's link for one collective on one ring: adds seq + signature (and the ring's id to the
    step), enforces the deadline. ``rank`` / ``size`` are this rank's position in that ring.
    ``backend`` is the ``HostBackend`` running it (its mailbox, shared buffers and ``arrivals``
    explain failures)."""

    def __init__(self, backend, ring: "links.RingLinks", seq: int, sig: str, deadline: float,
                 timeout: float, ring_id: Optional[int] = None):
        self.rank = ring.rank
        self.size = ring.size
        self._b = backend
        self._ring = ring
        self._seq = seq
        self._sig = sig.encode()
        self._sig_text = sig
        self._deadline = deadline
        self._timeout = timeout
        self._left = ring.left  # global rank
        self._rid = ring.ring_id if ring_id is None else ring_id  # namespaces this phase's frames
        self._subs: List["CollectiveLink"] = []

    def on(self, ring: "links.RingLinks", phase_id: Optional[int] = None) -> "CollectiveLink":
        """The same collective (seq, signature, deadline) on another ring of this rank; ``phase_id``
        keeps a second phase on the same ring apart from the first."""
        sub = CollectiveLink(self._b, ring, self._seq, self._sig_text, self._deadline, self._timeout, phase_id)
        self._subs.append(sub)
        return sub

    def _abort(self):
        """What a wait of this collective must raise now: another rank's reported failure, (with shared
        all-reduce buffers) a peer that entered this collective under another signature, or a peer that
        has long been inside a collective of a layer above instead (``ProcessGroup.add_collective_watch``)."""
        flags = self._b.flags
        # the watches first: a peer's shared-memory word that names the cause is there before its abort message
        return (self._watched() or self._b.mailbox.error_now()
                or (flags.entries.conflict(self._seq, self._sig_text) if flags else None))

    abort_now = _abort  # for the shared-buffer all-reduce's waits

    def _watched(self):
        for w in self._b.group.collective_watches:
            problem = w.python_problem(self._seq, self._sig_text)
            if problem is not None:
                return problem
        return None

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def global_rank(self) -> int:
        """This rank in the job (``rank`` is its position on this ring, which differs on the
        hierarchical host and leader rings)."""
        return self._b.rank

    @property
    def left_rank(self) -> int:
        """The job rank of the left neighbour on this ring, whose data this rank receives."""
        return self._left

    @property
    def deadline(self) -> float:
        return self._deadline

    def timeout_error(self, waiting_for: List[int]) -> CollectiveTimeoutError:
        """The deadline passed in the shared-buffer all-reduce while ``waiting_for`` had not arrived."""
        arrived, missing, detail = self._b.arrivals(self._seq, waiting_for[0])
        return CollectiveTimeoutError(
            f"collective #{self._seq} [{self._sig_text}] timed out after {self._timeout:g} s in the shared-memory "
            f"all-reduce waiting for ranks {list(waiting_for)}: arrived: ranks {arrived}; not arrived: {detail}",
            rank=self._b.rank, seq=self._seq, waiting_for=missing,
            fix="a rank is missing, stuck, or calling a different sequence of collectives; check that every rank "
                "runs the same code path, or raise the deadline (timeout=, "
                "CommunicationOptions(timeout_seconds=...), TFCS_TIMEOUT)")

    def send(self, key, payload) -> None:
        self._b.bytes_sent += len(payload)
        self._ring.stream.send_frame(self._seq, links.wire_step(self._rid, key[0]), key[1], self._sig, payload)

    def finish(self) -> None:
        """The collective is done here: make sure our last frames left before the buffer is returned."""
        for sub in self._subs:
            sub.finish()
        if self._ring.stream is None:
            return
        if self._ring.inbound is not None:
            self._ring.inbound.release()
        self._ring.stream.drain(max(0.1, self._deadline - time.monotonic()), abort=self._abort)

    def recv_into(self, key, dst: np.ndarray):
        """The payload for ``key``, read straight into ``dst`` (uint8) where the link can (a raw socket):
        then the array returned is ``dst``; otherwise the caller copies it."""
        return self.recv(key, into=dst)

    def recv(self, key, into=None):
        right = self._ring.stream
        pump = right.pump if right is not None else None  # an inline outbound writes queued frames meanwhile
        wkey = (self._seq, links.wire_step(self._rid, key[0]), key[1])
        inbound = self._ring.inbound
        if isinstance(inbound, socket_transport.SocketReceiver):  # a raw socket, read in this thread
            item = inbound.take(wkey, self._deadline, self._sig, abort=self._abort, outbound=right, into=into)
        elif inbound is not None:  # shared memory, read in this thread
            item = inbound.take(wkey, self._deadline, self._sig, abort=self._abort, outbound=right)
        else:
            item = self._b.mailbox.take(wkey, self._deadline, self._left, self._sig,
                                        health=right.broken if right is not None else None, pump=pump)
        if item is None:
            broken = right.broken() if right is not None else None
            if broken is not None:
                raise broken
            arrived, missing, detail = self._b.arrivals(self._seq, self._left)
            raise CollectiveTimeoutError(
                f"collective #{self._seq} [{self._sig_text}] timed out after {self._timeout:g} s at step "
                f"{key[0]} chunk {key[1]} waiting for rank {self._left}: arrived: ranks {arrived}; not arrived: "
                f"{detail}", rank=self._b.rank, seq=self._seq, waiting_for=missing,
                fix="a rank is missing, stuck, or calling a different sequence of collectives; check that "
                    "every rank runs the same code path, or raise the deadline (timeout=, "
                    "CommunicationOptions(timeout_seconds=...), TFCS_TIMEOUT)")
        sig, payload = item
        if sig != self._sig:
            theirs = sig.decode(errors="replace")
            raise CollectiveMismatchError(
                f"collective #{self._seq} mismatch: this rank called [{self._sig_text}] but rank {self._left} "
                f"called [{theirs}]", rank=self._b.rank, seq=self._seq, local_signature=self._sig_text,
                remote_signature=theirs, remote_rank=self._left,
                fix="every rank must issue the same collectives in the same order with the same op, dtype, "
                    "shape and root")
        return payload
