"""The other ranks of the job as the host backend sees them: their addresses, how to describe them in
an error, the heartbeats to the ring neighbours, who is lost, and the abort message every failure sends.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Set, Tuple

from ... import config
from ...errors import CollectiveAbortedError, PeerLostError
from . import liveness, transport


class Peers:
    """This rank's view of the other ranks (one per host backend).

    Args:
      group: the process group (``core.backend.Group``).
    """

    def __init__(self, group):
        self.group, self.rank, self.size = group, group.rank, group.size
        self.addresses: List[str] = []  # every rank's gRPC data server, in rank order (after setup)
        self.lost: Set[int] = set()
        self._probes: Dict[int, liveness.PeerProbe] = {}
        self._watchdog: Optional[liveness.Watchdog] = None

    def address_of(self, rank: int) -> str:
        return self.addresses[rank] if rank < len(self.addresses) else "?"

    def describe(self, rank: int) -> str:
        """'host NAME, pid N, ADDRESS' of a rank, for error messages."""
        try:
            w = self.group.workers[rank]
            return f"host {w.hostname}, pid {w.pid}, {self.address_of(rank)}"
        except (IndexError, AttributeError, TypeError):
            return self.address_of(rank)

    def _probe(self, rank: int) -> liveness.PeerProbe:
        p = self._probes.get(rank)
        if p is None:
            p = self._probes[rank] = liveness.PeerProbe(self.address_of(rank), self.group.token, self.rank,
                                                        tls=self.group.tls)
        return p

    def watch(self, neighbours: Set[int], on_lost: Callable[[int, BaseException], None],
              is_gone: Callable[[int], bool]) -> None:
        """Heartbeats to ``neighbours`` (``TFCS_HEARTBEAT_TIMEOUT``; 0: none): ``on_lost(rank, error)``
        when one stops answering."""
        timeout = config.heartbeat_timeout_from_env()
        neighbours = sorted(set(neighbours) - {self.rank})
        if timeout <= 0 or not neighbours:
            return
        probes = {r: self._probe(r) for r in neighbours}

        def lost(rank: int, error: BaseException) -> None:
            self.lost.add(rank)
            on_lost(rank, error)
        self._watchdog = liveness.Watchdog(self.rank, neighbours, probes, self.describe, lost,
                                           interval=min(1.0, timeout / 4), timeout=timeout, is_gone=is_gone)

    def arrivals(self, seq: int, waited_on: int) -> Tuple[List[int], List[int], str]:
        """After a timeout at collective ``seq``: (arrived ranks, missing ranks, text about the missing)."""
        answers = liveness.progress_of({r: self._probe(r) for r in range(self.size)
                                        if r != self.rank and r not in self.lost})
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

    def tell_abort(self, error: BaseException) -> None:
        """Send ``error`` to every rank not known to be lost (each at most 3 s), so they fail at once
        instead of at their deadline."""
        msg = f"{type(error).__name__}: {error}"
        peer = getattr(error, "peer_rank", None) if isinstance(error, PeerLostError) else None
        if peer is not None:
            self.lost.add(peer)
        kw = {"kind": type(error).__name__, "peer": peer, "tls": self.group.tls,
              "seq": getattr(error, "seq", None), "waiting_for": getattr(error, "waiting_for", ())}
        threads = [threading.Thread(target=transport.send_abort, args=(a, self.group.token, self.rank, msg),
                                    kwargs=kw, daemon=True)
                   for i, a in enumerate(self.addresses) if i != self.rank and i not in self.lost]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3.0)

    @staticmethod
    def came_from_a_peer(error: BaseException, remote_error: Optional[BaseException]) -> bool:
        """Whether ``error`` was reported by another rank (which told everybody already)."""
        return isinstance(error, CollectiveAbortedError) or error is remote_error

    def quiesce(self) -> None:
        """Stop the heartbeats (shutdown has begun: peers going away is expected now)."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def close(self) -> None:
        self.quiesce()
        for p in self._probes.values():
            p.close()
        self._probes = {}
