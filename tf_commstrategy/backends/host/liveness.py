"""Peer liveness for the ring: heartbeats to the ring neighbours over the gRPC control plane.

A dead process on the same host shows up at once (its sockets close, its port refuses), but a host
whose network link went down, or a process that is frozen, says nothing: TCP keeps retrying for
minutes. So every rank pings its two ring neighbours' data servers (``Data/Ping``) once per
``interval`` and declares a neighbour lost when

* its port refuses connections on two pings in a row (the process is gone), or
* it has not answered at all for ``timeout`` seconds (frozen, or the network is partitioned); a ping
  waits at most 2 s and never past that limit, so the verdict comes within ``interval`` of it.

A lost neighbour poisons this rank's mailbox with a :class:`PeerLostError` naming it, and the
backend tells every other rank (``Data/Abort`` carries the error kind and the lost rank), so all
survivors raise ``PeerLostError`` for the same rank. The ping answer carries the peer's collective
progress, which a timed-out collective uses to say which ranks had arrived (``progress_of``).

Defaults: ``interval`` 1 s, ``timeout`` 10 s (``TFCS_HEARTBEAT_TIMEOUT``; 0 turns heartbeats off).
A collective deadline shorter than ``timeout`` fires first, as a :class:`CollectiveTimeoutError`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional

import grpc

from ...core import grpc_util
from ...errors import PeerLostError

log = logging.getLogger("tf_commstrategy")
SERVICE = "Data"


class PeerProbe:
    """Unary ``Ping`` calls to one peer over a channel of its own."""

    def __init__(self, address: str, token: Optional[str], my_rank: int, tls=None):
        self.address = address
        self._channel = grpc_util.open_channel(address, tls=tls)
        self._call = grpc_util.unary(self._channel, SERVICE, "Ping")
        self._md = tuple(grpc_util.call_metadata(token) or ()) + (("tfcs-rank", str(my_rank)),)

    def ping(self, timeout: float) -> dict:
        """The peer's progress ``{"rank", "started", "failed"}``; raises grpc.RpcError."""
        return json.loads(self._call(b"", timeout=timeout, metadata=self._md))

    def close(self) -> None:
        self._channel.close()


class Watchdog:
    """Background heartbeats to ``neighbours``; calls ``on_lost(rank, PeerLostError)`` once per lost peer."""

    def __init__(self, my_rank: int, neighbours: List[int], probes: Dict[int, PeerProbe],
                 describe: Callable[[int], str], on_lost: Callable[[int, PeerLostError], None],
                 interval: float = 1.0, timeout: float = 10.0, is_gone: Callable[[int], bool] = lambda r: False):
        self.my_rank = my_rank
        self._neighbours = sorted(set(neighbours) - {my_rank})
        self._probes = probes
        self._describe = describe
        self._on_lost = on_lost
        self._is_gone = is_gone
        self.interval = interval
        self.timeout = timeout
        self._stop = threading.Event()
        self._quiet = set()  # peers that said goodbye, or were already reported
        self._thread = threading.Thread(target=self._loop, name="tfcs-heartbeat", daemon=True)
        if self._neighbours and timeout > 0:
            self._thread.start()

    def forget(self, rank: int) -> None:
        """Stop watching ``rank`` (it shut down cleanly)."""
        self._quiet.add(rank)

    def _loop(self) -> None:
        last_ok = {r: time.monotonic() for r in self._neighbours}
        refused = {r: 0 for r in self._neighbours}
        while not self._stop.wait(self.interval):
            for r in self._neighbours:
                if r in self._quiet or self._stop.is_set() or self._is_gone(r):
                    continue
                # a ping waits at most 2 s, and never past the moment the silence reaches the limit, so a
                # frozen peer is declared lost at the limit, not up to one ping timeout after it
                left = self.timeout - (time.monotonic() - last_ok[r])
                try:
                    self._probes[r].ping(timeout=max(0.1, min(self.timeout, max(2.0, 2 * self.interval), left)))
                    last_ok[r], refused[r] = time.monotonic(), 0
                    continue
                except grpc.RpcError as e:
                    code = e.code() if hasattr(e, "code") else None
                    detail = f"{code}: {e.details() if hasattr(e, 'details') else e}"
                except Exception as e:  # pragma: no cover - never let the watchdog die silently
                    code, detail = None, repr(e)
                if self._stop.is_set() or r in self._quiet:
                    continue
                silent = time.monotonic() - last_ok[r]
                if code == grpc.StatusCode.UNAVAILABLE and "refused" in detail.lower():
                    refused[r] += 1
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    continue  # a configuration problem, reported by the data path itself
                if refused[r] >= 2:
                    why = (f"rank {r} ({self._describe(r)}) is gone: its port refuses connections "
                           f"({detail}); the process died or was killed")
                elif silent >= self.timeout:
                    why = (f"rank {r} ({self._describe(r)}) has not answered heartbeats for {silent:.1f} s "
                           f"(limit {self.timeout:g} s, last error {detail}): the process is frozen or the "
                           f"network to its host is down")
                else:
                    continue
                self._quiet.add(r)
                err = PeerLostError(why, rank=self.my_rank, peer_rank=r, peer_address=self._probes[r].address,
                                    fix=f"look at rank {r}'s host and log; restart the job (tfcs-run "
                                        f"--max-restarts, BackupAndRestore resumes training)")
                log.error("tf_commstrategy rank %d: %s", self.my_rank, why)
                try:
                    self._on_lost(r, err)
                except Exception:  # pragma: no cover
                    log.exception("tf_commstrategy rank %d: reporting a lost peer failed", self.my_rank)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)


def progress_of(probes: Dict[int, PeerProbe], timeout: float = 1.5) -> Dict[int, Optional[dict]]:
    """Ask every peer in ``probes`` for its progress at once; None for those that did not answer."""
    if not probes:
        return {}

    def one(item):
        r, p = item
        try:
            return r, p.ping(timeout)
        except Exception:
            return r, None

    with ThreadPoolExecutor(max_workers=min(16, len(probes))) as ex:
        return dict(ex.map(one, probes.items()))
