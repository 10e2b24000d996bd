"""The rendezvous: rank 0 hosts the coordinator, every worker publishes who and where it is.

After ``join`` returns, every worker knows every other worker's hostname, boot id and pid, so
local rank / local size follow from who shares this host, and backends can publish their own
addresses through the returned store.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import socket
import time
from typing import List, Optional

from ..errors import RendezvousError
from .cluster_env import ClusterSpec, join_host_port, split_host_port
from .coordinator import CoordinatorClient, CoordinatorServer


def is_loopback(host: str) -> bool:
    """True for "localhost" and loopback addresses (127.0.0.0/8, ::1).

    Args:
      host: a host name or address.

    Returns:
      Whether it is this machine's loopback.
    """
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def boot_id() -> str:
    """This machine's boot id (with the hostname, tells which workers share a host).

    Returns:
      ``/proc/sys/kernel/random/boot_id``, or "unknown" where there is none.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # pragma: no cover - non-Linux
        return "unknown"


def default_bind_host(coordinator_host: str) -> str:
    """Where servers listen by default: loopback for a loopback coordinator, else every interface.

    Args:
      coordinator_host: the coordinator's host.

    Returns:
      "127.0.0.1" or "0.0.0.0"; "::1" or "::" for an IPv6 coordinator address.
    """
    v6 = ":" in coordinator_host
    if is_loopback(coordinator_host):
        return "::1" if v6 else "127.0.0.1"
    return "::" if v6 else "0.0.0.0"


def default_advertise_host(coordinator_host: str) -> str:
    """The address peers should use for this worker: the interface that routes to the coordinator.

    A UDP ``connect`` only consults the routing table; it sends no packet.

    Args:
      coordinator_host: the coordinator's host.

    Returns:
      "127.0.0.1" ("::1") for a loopback coordinator, else this host's address on the route to it (the
      hostname if that cannot be found).
    """
    if is_loopback(coordinator_host):
        return "::1" if ":" in coordinator_host else "127.0.0.1"
    try:
        infos = socket.getaddrinfo(coordinator_host, 9, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


@dataclasses.dataclass
class WorkerInfo:
    """What each worker publishes at the rendezvous: its rank, hostname, boot id, pid, and the
    network and mount namespaces it runs in (Linux; empty elsewhere)."""

    rank: int
    hostname: str
    boot_id: str
    pid: int
    netns: str = ""
    mntns: str = ""
    pidns: str = ""

    @property
    def host_key(self):
        """Same machine (local rank and local size count these)."""
        return (self.hostname, self.boot_id)

    @property
    def local_link_key(self):
        """Same machine AND same network namespace: Unix abstract sockets reach each other only then."""
        return (self.hostname, self.boot_id, self.netns)

    @property
    def shm_key(self):
        """Same machine, /dev/shm and pids: shared-memory links (and their liveness checks) work."""
        return (self.hostname, self.boot_id, self.netns, self.mntns, self.pidns)


def namespace_id(kind: str) -> str:
    """The inode of /proc/self/ns/<kind> ("net", "mnt"), or "" where there is none."""
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return ""


@dataclasses.dataclass
class Rendezvous:
    """The result of ``join``: the coordinator store, rank 0's server, every worker, local rank and size."""

    store: Optional[CoordinatorClient]
    server: Optional[CoordinatorServer]
    workers: List[WorkerInfo]
    local_rank: int
    local_size: int

    def close(self) -> None:
        """Close the client, and stop the coordinator on rank 0."""
        if self.store is not None:
            self.store.close()
        if self.server is not None:
            self.server.stop()


FAILED_KEY = "rendezvous/failed"
FAILED_SEEN_KEY = "rendezvous/failed_seen"
FAILED_LINGER_S = 3.0
_JOIN_FIX = ("start every worker with the same world size and coordinator address (a worker that crashed at "
             "start has its own error in its log), or raise TFCS_RENDEZVOUS_TIMEOUT when workers start slowly")


def _gather_workers(store, spec: ClusterSpec, timeout: float, end: float, hosts_coordinator: bool
                    ) -> List[WorkerInfo]:
    """Every worker's info, waiting until ``end``; the error names every rank still missing.

    The first rank to reach its deadline publishes what it saw under ``FAILED_KEY``: the ranks that joined
    stop waiting and raise the same message, whatever their own deadlines (the workers' clocks start at
    different times). Rank 0 hosts the coordinator, so before it exits it waits (at most
    ``FAILED_LINGER_S``) until every rank that joined has read that message; else a rank whose deadline
    comes later would only see the coordinator gone.
    """
    found = []
    for i in range(spec.world_size):
        try:
            key, value = store.get_either(f"worker/{i}", FAILED_KEY, max(0.0, end - time.monotonic()))
        except RendezvousError:
            # a failed call (rank 0's coordinator gone) raises its own error here, naming the coordinator;
            # only keys the coordinator says are not set count as missing ranks
            missing = [j for j in range(i, spec.world_size) if store.try_get(f"worker/{j}") is None]
            what = f"rank(s) {missing} of a job of {spec.world_size} did not join within {timeout:.0f} s"
            store.set(FAILED_KEY, what)
            _linger(store, spec, hosts_coordinator)
            raise RendezvousError(what, rank=spec.rank, address=spec.coordinator, fix=_JOIN_FIX) from None
        if key == FAILED_KEY:
            _linger(store, spec, hosts_coordinator)
            raise RendezvousError(value, rank=spec.rank, address=spec.coordinator, fix=_JOIN_FIX)
        found.append(value)
    return [WorkerInfo(**json.loads(x)) for x in found]


def _linger(store, spec: ClusterSpec, hosts_coordinator: bool) -> None:
    """Acknowledge a published rendezvous failure; rank 0 also waits for the acknowledgements of every
    rank that joined, so its coordinator stays up until they have read why the job cannot start."""
    try:
        seen = store.add(FAILED_SEEN_KEY, 0 if hosts_coordinator else 1, timeout=2.0)
        if not hosts_coordinator:
            return
        joined = sum(store.try_get(f"worker/{j}", timeout=2.0) is not None
                     for j in range(spec.world_size) if j != spec.rank)
        stop = time.monotonic() + FAILED_LINGER_S
        while seen < joined and time.monotonic() < stop:
            time.sleep(0.02)
            seen = store.add(FAILED_SEEN_KEY, 0, timeout=2.0)
    except RendezvousError:
        pass  # best effort: the failure being reported is the one that matters


def join(spec: ClusterSpec, token: Optional[str], timeout: float, bind_host: Optional[str], tls=None) -> Rendezvous:
    """Meet every other worker of ``spec``; returns the store and who is where.

    A collective call: every worker of the job calls it. Rank 0 starts the coordinator first.

    Args:
      spec: this worker's rank, the world size and the coordinator address.
      token: the job token (None: no check).
      timeout: seconds to wait for the coordinator and for every worker.
      bind_host: where rank 0's coordinator listens (None: loopback for a loopback coordinator,
        else every interface).

    Returns:
      The ``Rendezvous``: store, server (rank 0 only), every worker's info, local rank and size.

    Raises:
      RendezvousError: the coordinator cannot be started or reached, or a worker is missing at the deadline.
    """
    me = WorkerInfo(spec.rank, socket.gethostname(), boot_id(), os.getpid(), namespace_id("net"),
                    namespace_id("mnt"), namespace_id("pid"))
    if spec.world_size == 1:
        return Rendezvous(None, None, [me], 0, 1)
    host, port = split_host_port(spec.coordinator)
    server = None
    if spec.rank == 0:
        bind = bind_host or default_bind_host(host)
        server = CoordinatorServer(join_host_port(bind, port),
                                   spec.world_size, token, tls=tls)
    end = time.monotonic() + timeout  # one deadline for the whole meeting, however the workers trickle in
    store = CoordinatorClient(spec.coordinator, spec.rank, token, tls=tls)
    try:
        store.wait_ready(timeout)
        claims = store.add(f"claim/{spec.rank}", 1)
        if claims != 1:
            raise RendezvousError(f"rank {spec.rank} was claimed by {claims} workers", rank=spec.rank,
                                  address=spec.coordinator,
                                  fix="give every worker a distinct rank (check TFCS_RANK / the launcher); if the "
                                      "ranks are distinct, another job (or an earlier init still shutting down) "
                                      f"uses the coordinator at {spec.coordinator}: give this job its own port")
        store.set(f"worker/{spec.rank}", json.dumps(dataclasses.asdict(me)))
        workers = _gather_workers(store, spec, timeout, end, hosts_coordinator=server is not None)
        store.barrier("rendezvous", spec.world_size, max(1.0, end - time.monotonic()))
    except BaseException:  # also KeyboardInterrupt: never leave rank 0's coordinator serving
        store.close()
        if server is not None:
            server.stop()
        raise
    same = [w.rank for w in workers if w.host_key == me.host_key]
    local_rank = spec.local_rank if spec.local_rank is not None else same.index(spec.rank)
    return Rendezvous(store, server, workers, local_rank, len(same))
